"""Configuration of TLS front-end listeners: what loads and what is refused, by file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, ConfigProblem, load_config
from gateway.protocols.frontend.settings import FrontendSettings
from tests.certs import Pki, make_pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A fresh test PKI under ``tmp_path/pki``."""
    directory = tmp_path / "pki"
    directory.mkdir()
    return make_pki(directory)


def mtls(pki: Pki, extra: str = "") -> str:
    """An mtls: endpoint requiring client certificates from the test CA."""
    return (
        f"mtls:0:certKey={pki.server_cert}:privateKey={pki.server_key}:caCerts={pki.ca_cert}"
        + extra
    )


def write(tmp_path: Path, listener: str, secrets: str = "", routes: str = "") -> Path:
    """Write a main file with one front-end listener table (and a secrets file)."""
    (tmp_path / "secrets.toml").write_text(secrets)
    main = tmp_path / "gateway.toml"
    main.write_text(
        '[gateway]\nsecrets = "secrets.toml"\n[admin]\nenabled = false\n'
        '[listeners.hub]\nprotocol = "ssmp"\nendpoint = "tcp:0"\nschemes = ["open"]\n'
        f'[listeners.front]\nprotocol = "frontend"\n{listener}\n{routes}'
    )
    return main


def problems(path: Path) -> list[ConfigProblem]:
    """The problems of an invalid config."""
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return caught.value.problems


def test_a_front_end_loads(tmp_path: Path, pki: Pki) -> None:
    """speaks, backend and time-outs load; the secrets file's [frontends.NAME] is read."""
    path = write(
        tmp_path,
        f'speaks = "ssmp"\nendpoint = "{mtls(pki)}"\nbackend = "tcp:host=127.0.0.1:port=7001"\n'
        "connect_timeout_seconds = 2.5\nmax_connections = 10\n",
        secrets='[frontends.front]\nalice = "a-secret"\n"*" = "shared"\n',
    )
    config = load_config(path)
    front = next(listener for listener in config.listeners if listener.name == "front")
    assert front.protocol == "frontend"
    assert front.max_connections == 10
    assert front.settings == FrontendSettings(
        speaks="ssmp", backend="tcp:host=127.0.0.1:port=7001", connect_timeout_seconds=2.5
    )
    assert dict(config.secrets.frontends["front"]) == {"alice": b"a-secret", "*": b"shared"}


@pytest.mark.parametrize(
    ("listener", "key", "fragment"),
    [
        ('speaks = "qmqp"\nendpoint = "tcp:0"\nbackend = "tcp:host=h:port=1"', "endpoint", "mtls"),
        (
            'speaks = "qmqp"\nendpoint = "{tls}:verify=optional"\nbackend = "tcp:host=h:port=1"',
            "endpoint",
            "verify=required",
        ),
        ('speaks = "dmp"\nendpoint = "{tls}"\nbackend = "tcp:host=h:port=1"', "speaks", "one of"),
        (
            'speaks = "qmqp"\nendpoint = "{tls}"\nbackend = "tcp:host=h"',
            "backend",
            "bad client endpoint",
        ),
        ('speaks = "qmqp"\nendpoint = "{tls}"', "backend", "is required"),
    ],
)
def test_bad_front_ends_are_refused(
    tmp_path: Path, pki: Pki, listener: str, key: str, fragment: str
) -> None:
    """Each mistake is reported once, at its key."""
    found = problems(write(tmp_path, listener.replace("{tls}", mtls(pki))))
    assert [problem.key for problem in found] == [f"listeners.front.{key}"], found
    assert fragment in found[0].reason


def test_an_ssmp_front_end_needs_backend_secrets(tmp_path: Path, pki: Pki) -> None:
    """Without a [frontends.NAME] table in the secrets file an SSMP front-end is refused."""
    path = write(
        tmp_path, f'speaks = "ssmp"\nendpoint = "{mtls(pki)}"\nbackend = "tcp:host=h:port=1"'
    )
    found = problems(path)
    assert [(problem.file, problem.key) for problem in found] == [
        (str(tmp_path / "secrets.toml"), "frontends.front")
    ]


def test_routes_cannot_end_at_a_front_end(tmp_path: Path, pki: Pki) -> None:
    """A front-end relays outside any route: a route to it is refused."""
    path = write(
        tmp_path,
        f'speaks = "qmqp"\nendpoint = "{mtls(pki)}"\nbackend = "tcp:host=h:port=1"',
        routes='[routes.r]\nfrom = "hub"\nmatch = "#"\nto = "front"\n',
    )
    found = problems(path)
    assert [problem.key for problem in found] == ["routes.r.to"]
    assert "TLS front-end" in found[0].reason
