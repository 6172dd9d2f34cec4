"""Every shipped example, as ``msggateway init`` writes it, runs under a real twistd and works.

Each test writes an example with ``msggateway init --example NAME DIR``
(in-process), turns its listening ports to 0 (tests never use fixed ports)
and its upstreams to the servers the test started, and starts twistd on it.
Then traffic goes through it as the example's header says:

* the starter (etc/gateway.toml), its central upstream being the embedded
  default's SSMP hub as shipped: weather goes up to central, alerts come
  down;
* ssmp-to-rabbitmq: MCAST on events.# lands in a stream of a real RabbitMQ
  (the ``rabbitmq`` fixture), through the durable route;
* qmqp-to-dmp: mail reaches the sink of the embedded default's DMP listener,
  read from its feed;
* tls-frontend: a client certificate login relayed to a plaintext SSMP
  backend, which sees the secret init made;
* mtl-ssmp: MTL content to SSMP subscribers, SSMP MCAST to MTL readers.

The secrets the examples need are the random ones init wrote, read back
with the configuration loader.
"""

from __future__ import annotations

import asyncio
import io
import re
import shutil
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.config import GatewayConfig, load_config
from tests.certs import Pki, make_pki
from tests.integration.harness import GatewayProcess, LineClient, read_stream_until
from tests.integration.test_frontend import alice
from tests.integration.test_qmqp import QMQPSession, mail

pytestmark = pytest.mark.integration

WAIT_SECONDS = 20.0


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), out, err, io.BytesIO())
    return status, out.getvalue(), err.getvalue()


def _on_port_0(text: str) -> str:
    """Every listening port (server endpoints, MTL data ports, admin) turned to 0."""
    text = re.sub(r'(?m)^(endpoint = "(?:tcp|mtls)):\d+:', r"\1:0:", text)
    text = re.sub(r"(?m)^data_port = \d+", "data_port = 0", text)
    return text.replace("interface=0.0.0.0", "interface=127.0.0.1")


def _upstream_port(text: str, shipped: int, port: int) -> str:
    """An upstream's (or backend's) ``port=SHIPPED`` made ``port=PORT``."""
    assert f"port={shipped}" in text
    return text.replace(f"port={shipped}", f"port={port}")


def _example(name: str, directory: Path) -> tuple[str, GatewayConfig]:
    """``msggateway init --example NAME DIRECTORY``: the main file's text on port 0, and it loaded.

    The configuration is loaded before the ports change, for its secrets.
    """
    status, _, err = _run(
        "init", "--example", name, "--data-dir", str(directory / "data"), str(directory)
    )
    assert status == 0, err
    config = load_config(directory / "gateway.toml")
    return _on_port_0((directory / "gateway.toml").read_text()), config


def _embedded_default(directory: Path) -> GatewayProcess:
    """The embedded default as twistd runs it, on port 0."""
    default = resources.files("gateway").joinpath("default.toml").read_text("utf-8")
    text = re.sub(r"tcp:\d+:", "tcp:0:", default)
    text = re.sub(r"(?m)^data_port = \d+$", "data_port = 0", text)
    return GatewayProcess(directory, text).start()


@pytest.fixture
def default_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    """The embedded default, running: the starter's central, qmqp-to-dmp's DMP server."""
    process = _embedded_default(tmp_path / "default")
    yield process
    process.stop()


def test_the_starter_bridges_to_the_embedded_defaults_hub(
    tmp_path: Path, default_gateway: GatewayProcess
) -> None:
    """Weather MCAST on the starter reaches central's subscribers; central's alerts come down."""
    text, config = _example("starter", tmp_path / "starter")
    text = _upstream_port(text, 8787, default_gateway.address("ssmp")[1])
    starter = GatewayProcess(tmp_path / "starter", text).start()
    try:
        starter.wait_for_log("upstream central: ", timeout=WAIT_SECONDS)
        secret = config.secrets.logins["alice"].decode()
        with (
            LineClient(default_gateway.address("ssmp")) as central,
            LineClient(starter.address("hub")) as local,
        ):
            central.send("LOGIN watcher open", "SUBSCRIBE weather.today")
            central.expect("200")
            central.expect("200")
            local.send(f"LOGIN alice secret {secret}", "SUBSCRIBE central.alerts")
            local.expect("200")
            local.expect("200")
            local.send("MCAST weather.today sunny")
            local.expect("200")  # central answered
            central.expect("000 gateway-1 MCAST weather.today sunny")
            central.send("MCAST alerts storm warning")
            central.expect("200")
            line = local.read_line()
            assert line.startswith(b"000 ") and line.endswith(
                b" MCAST central.alerts storm warning"
            )
    finally:
        starter.stop()


def test_ssmp_to_rabbitmq(tmp_path: Path, rabbitmq: Any, stream_name: str) -> None:
    """MCAST on events.# is in the RabbitMQ stream once the durable route said 200."""
    pytest.importorskip("rstream", reason="rstream is installed by ./dev test")
    text, config = _example("ssmp-to-rabbitmq", tmp_path)
    text = _upstream_port(text, 5552, rabbitmq.stream_connection()["port"])
    text = text.replace('address = "events"', f'address = "{stream_name}"')
    gateway = GatewayProcess(tmp_path, text).start()
    try:
        gateway.wait_for_log("upstream rabbit: connected", timeout=WAIT_SECONDS)
        secret = config.secrets.logins["publisher"].decode()
        with LineClient(gateway.address("hub")) as publisher:
            publisher.send(f"LOGIN publisher secret {secret}")
            publisher.expect("200")
            publisher.send("MCAST events.orders order 1", "MCAST events.orders order 2")
            publisher.expect("200")
            publisher.expect("200")
        got: list[bytes] = []

        def take(message: Any, _context: Any) -> bool:
            got.append(bytes(message.body))
            return len(got) >= 2

        asyncio.run(
            asyncio.wait_for(
                read_stream_until(rabbitmq.stream_connection(), stream_name, take, create=True),
                60,
            )
        )
        assert got == [b"order 1", b"order 2"]
    finally:
        gateway.stop()


def test_qmqp_to_dmp(
    tmp_path: Path, default_gateway: GatewayProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mail to @orders.example.org is K once logged, then in the DMP sink, read from its feed."""
    text, _ = _example("qmqp-to-dmp", tmp_path / "example")
    host, port = default_gateway.address("dmp")
    text = _upstream_port(text, 5554, port)
    gateway = GatewayProcess(tmp_path / "example", text).start()
    try:
        gateway.wait_for_log("upstream orders: ", timeout=WAIT_SECONDS)
        monkeypatch.setenv("DEMO_FEED", "demo-feed")
        got: list[tuple[int, str, str]] = []
        get = ("dmp", "get", "-a", f"{host}:{port}", "--lease-env", "DEMO_FEED")
        reader = threading.Thread(
            target=lambda: got.append(_run(*get, "--count", "1", "--timeout", "30"))
        )
        reader.start()
        # What the sink gets before the feed has its reader goes nowhere (DMP has no
        # queue): mail until the reader has one.
        number = 0
        while reader.is_alive():
            number += 1
            assert number < 100, "the feed's reader got nothing"
            client = QMQPSession(gateway.address("mail"))
            try:
                client.send(
                    mail(f"o-{number}", "new@orders.example.org", subject="order") + b"1:D,"
                )
                reply, _done = client.read_blocks(2)
            finally:
                client.close()
            assert getattr(reply, "status", None) == b"K", reply
            reader.join(0.3)
        [(status, out, err)] = got
        assert status == 0, err
        assert "Subject: order" in out, out
    finally:
        gateway.stop()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A fresh test PKI."""
    directory = tmp_path / "pki"
    directory.mkdir()
    return make_pki(directory)


def test_tls_frontend(tmp_path: Path, pki: Pki) -> None:
    """A certificate login (alice's) reaches the plaintext backend with the secret init made."""
    directory = tmp_path / "front"
    status, _, err = _run(
        "init", "--example", "tls-frontend", "--data-dir", str(directory / "data"), str(directory)
    )
    assert status == 0 and "tls/server.pem: cannot read" in err
    (directory / "tls").mkdir()
    shutil.copy(pki.server_cert, directory / "tls" / "server.pem")
    shutil.copy(pki.server_key, directory / "tls" / "server.key")
    shutil.copy(pki.ca_cert, directory / "tls" / "clients-ca.pem")
    config = load_config(directory / "gateway.toml")
    secret = config.secrets.frontends["chat-tls"]["alice"].decode()
    backend = GatewayProcess(
        tmp_path / "backend",
        '[admin]\nenabled = false\n[gateway]\nsecrets = "secrets.toml"\n'
        '[listeners.hub]\nprotocol = "ssmp"\nendpoint = "tcp:0:interface=127.0.0.1"\n'
        'schemes = ["secret"]\n',
        secrets=f'[logins]\nalice = "{secret}"\nbob = "bob-secret"\n',
    ).start()
    text = _on_port_0((directory / "gateway.toml").read_text())
    front = GatewayProcess(directory, _upstream_port(text, 4000, backend.address("hub")[1])).start()
    try:
        with (
            LineClient(backend.address("hub")) as bob,
            LineClient(front.address("chat-tls"), alice(pki)) as client,
        ):
            bob.send("LOGIN bob secret bob-secret", "SUBSCRIBE news")
            bob.expect("200")
            bob.expect("200")
            client.send("LOGIN alice cert")
            client.expect("200")
            client.send("MCAST news hello over TLS")
            client.expect("200")
            bob.expect("000 alice MCAST news hello over TLS")
    finally:
        front.stop()
        backend.stop()


def test_mtl_ssmp_both_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MTL content on sensors.* reaches SSMP subscribers; SSMP commands.* reach MTL readers."""
    text, config = _example("mtl-ssmp", tmp_path)
    gateway = GatewayProcess(tmp_path, text).start()
    try:
        monkeypatch.setenv("PROBE_PASSWORD", config.secrets.logins["probe"].decode())
        ops = config.secrets.logins["ops"].decode()
        host, port = gateway.address("mtl")
        mtl = ("-a", f"{host}:{port}", "--profile", "gateway", "--confirm", "full",
               "--username", "probe", "--password-env", "PROBE_PASSWORD")  # fmt: skip
        with LineClient(gateway.address("hub")) as client:
            client.send(f"LOGIN ops secret {ops}", "SUBSCRIBE sensors.temp")
            client.expect("200")
            client.expect("200")
            sent = _run("mtl", "send", *mtl, "--resource", "sensors.temp", "21.5")
            assert sent == (0, "1 accepted\n", ""), sent
            client.expect("000 . MCAST sensors.temp 21.5")
            got: list[tuple[int, str, str]] = []
            receive = ("mtl", "receive", *mtl, "--resource", "commands.valve", "--count", "1")
            reader = threading.Thread(target=lambda: got.append(_run(*receive, "--timeout", "30")))
            reader.start()
            # No reader summoned yet is "retry later" (SSMP 4xx): publish until one took it.
            while True:
                client.send("MCAST commands.valve open")
                answer = client.read_line()
                if answer.startswith(b"200"):
                    break
                assert reader.is_alive(), got
                reader.join(0.2)
            reader.join(WAIT_SECONDS)
            [(status, out, err)] = got
            assert status == 0, err
            assert out.split() == ["commands.valve", "open"]
    finally:
        gateway.stop()
