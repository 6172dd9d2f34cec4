"""Configuration of TLS identities and TLS upstreams: what loads, what is refused, what is warned.

``cert_identity`` says which names of a client certificate a listener takes
as identities (the Common Name only by default).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, ConfigProblem, load_config
from tests.certs import Pki, make_pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A fresh test PKI under ``tmp_path/pki``."""
    directory = tmp_path / "pki"
    directory.mkdir()
    return make_pki(directory)


def mtls(pki: Pki) -> str:
    """An mtls: endpoint requiring client certificates from the test CA."""
    return f"mtls:0:certKey={pki.server_cert}:privateKey={pki.server_key}:caCerts={pki.ca_cert}"


def write(tmp_path: Path, tables: str) -> Path:
    """Write a main file with the given tables (and an empty secrets file)."""
    (tmp_path / "secrets.toml").write_text("")
    main = tmp_path / "gateway.toml"
    main.write_text(f'[gateway]\nsecrets = "secrets.toml"\n[admin]\nenabled = false\n{tables}')
    return main


def problems(path: Path) -> list[ConfigProblem]:
    """The problems of an invalid config."""
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return caught.value.problems


# --- cert_identity --------------------------------------------------------------------------


def test_cert_identity_is_the_common_name_by_default(tmp_path: Path, pki: Pki) -> None:
    """A listener that says nothing takes the Common Name only."""
    path = write(
        tmp_path,
        f'[listeners.hub]\nprotocol = "ssmp"\nendpoint = "{mtls(pki)}"\nschemes = ["cert"]',
    )
    (hub,) = load_config(path).listeners
    assert hub.cert_identity == ("cn",)


def test_cert_identity_takes_name_types(tmp_path: Path, pki: Pki) -> None:
    """Name types load in order, each once."""
    path = write(
        tmp_path,
        f'[listeners.hub]\nprotocol = "ssmp"\nendpoint = "{mtls(pki)}"\nschemes = ["cert"]\n'
        'cert_identity = ["email", "cn", "email", "dns", "uri", "ip"]',
    )
    (hub,) = load_config(path).listeners
    assert hub.cert_identity == ("email", "cn", "dns", "uri", "ip")


@pytest.mark.parametrize(
    ("value", "endpoint", "reason"),
    [
        ('["cn", "san"]', "mtls", "unknown name type(s) 'san'"),
        ("[]", "mtls", "name at least one name type"),
        ('["cn"]', "tcp:0:interface=127.0.0.1", "only an mtls: listener verifies"),
    ],
)
def test_cert_identity_problems(
    tmp_path: Path, pki: Pki, value: str, endpoint: str, reason: str
) -> None:
    """Unknown types, none at all, or a listener without client certificates: refused."""
    endpoint = mtls(pki) if endpoint == "mtls" else endpoint
    path = write(
        tmp_path,
        f'[listeners.hub]\nprotocol = "ssmp"\nendpoint = "{endpoint}"\nschemes = ["open"]\n'
        f"cert_identity = {value}",
    )
    (problem,) = problems(path)
    assert problem.key == "listeners.hub.cert_identity"
    assert reason in problem.reason
