"""Configuration of TLS identities and TLS upstreams: what loads, what is refused, what is warned.

``cert_identity`` says which names of a client certificate a listener takes
as identities (the Common Name only by default). ``ssl:`` client endpoints,
which verify nothing of the server, are refused unless an upstream opts out
with ``allow_unverified_tls``; what a valid configuration still exposes (that
opt-out, plaintext listeners other hosts reach that take passwords) is what
`insecure_settings` returns, for ``check-config`` and the log at every start.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, ConfigProblem, load_config
from gateway.config.insecure import insecure_settings
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


# --- ssl: client endpoints --------------------------------------------------------------------


SSL_UPSTREAM = 'endpoint = "ssl:host=127.0.0.1:port=9787"'


def test_an_ssl_upstream_is_refused(tmp_path: Path) -> None:
    """``ssl:`` verifies neither host name nor certificate: refused, pointing to tls:."""
    path = write(tmp_path, f'[upstreams.central]\nprotocol = "qmqp"\n{SSL_UPSTREAM}')
    (problem,) = problems(path)
    assert problem.key == "upstreams.central.endpoint"
    assert "ssl: does not verify the server" in problem.reason
    assert "use tls:host=HOST:port=PORT:trustRoots=CA-DIRECTORY" in problem.reason
    assert "allow_unverified_tls = true" in problem.reason


def test_an_ssl_upstream_with_ca_certs_is_refused_too(tmp_path: Path, pki: Pki) -> None:
    """With ``caCertsDir`` the chain is checked, but never the host name: still refused."""
    path = write(
        tmp_path,
        '[upstreams.central]\nprotocol = "qmqp"\n'
        f'endpoint = "ssl:host=localhost:port=9628:caCertsDir={pki.trust_dir}"',
    )
    (problem,) = problems(path)
    assert problem.key == "upstreams.central.endpoint"


def test_an_ssl_upstream_with_the_opt_out_loads_and_is_warned_about(tmp_path: Path) -> None:
    """``allow_unverified_tls = true`` lets it load; `insecure_settings` names it."""
    path = write(
        tmp_path,
        f'[upstreams.central]\nprotocol = "qmqp"\n{SSL_UPSTREAM}\nallow_unverified_tls = true',
    )
    config = load_config(path)
    (upstream,) = config.upstreams
    assert upstream.allow_unverified_tls and upstream.unverified_tls
    (warning,) = insecure_settings(config)
    assert warning.startswith("upstream central: ssl: does not verify the server's certificate")
    assert "use tls:" in warning


def test_the_opt_out_without_ssl_is_refused(tmp_path: Path) -> None:
    """An opt-out on a tls: or tcp: upstream would be forgotten: refused."""
    path = write(
        tmp_path,
        '[upstreams.central]\nprotocol = "qmqp"\nendpoint = "tcp:host=127.0.0.1:port=9787"\n'
        "allow_unverified_tls = true",
    )
    (problem,) = problems(path)
    assert problem.key == "upstreams.central.allow_unverified_tls"


def test_an_ssl_front_end_backend_is_refused(tmp_path: Path, pki: Pki) -> None:
    """A front-end's backend on ``ssl:`` is refused (no opt-out: use tls: or tcp:)."""
    path = write(
        tmp_path,
        f'[listeners.front]\nprotocol = "frontend"\nspeaks = "qmqp"\nendpoint = "{mtls(pki)}"\n'
        'backend = "ssl:host=127.0.0.1:port=7000"',
    )
    (problem,) = problems(path)
    assert problem.key == "listeners.front.backend"
    assert "ssl: does not verify the server" in problem.reason
    assert "allow_unverified_tls" not in problem.reason


def test_check_config_prints_the_warning(tmp_path: Path) -> None:
    """``check-config`` accepts the opt-out (status 0) with a ``warning:`` line on stderr."""
    path = write(
        tmp_path,
        f'[upstreams.central]\nprotocol = "qmqp"\n{SSL_UPSTREAM}\nallow_unverified_tls = true',
    )
    out, err = io.StringIO(), io.StringIO()
    assert main(["check-config", str(path)], out=out, err=err) == 0
    assert err.getvalue().startswith("warning: upstream central: ssl: does not verify")
    assert ": OK: " in out.getvalue()


# --- plaintext listeners that take passwords ------------------------------------------------


@pytest.mark.parametrize(
    ("table", "what"),
    [
        ('protocol = "stream"\nendpoint = "tcp:5552"', "SASL PLAIN passwords in clear on 0.0.0.0"),
        (
            'protocol = "stream"\nendpoint = "tcp6:5552:interface=\\\\:\\\\:"',
            "SASL PLAIN passwords in clear on ::",
        ),
        (
            'protocol = "ssmp"\nendpoint = "tcp:4000:interface=192.0.2.1"\nschemes = ["secret"]',
            "SSMP secret logins in clear on 192.0.2.1",
        ),
        (
            'protocol = "qmqp"\nendpoint = "tcp:628:interface=0.0.0.0"\nrequire_auth = true',
            "QMQP A-block passwords in clear on 0.0.0.0",
        ),
        (
            'protocol = "dmp"\nendpoint = "tcp:5672"\nsinks = ["s"]\nprincipals = ["app"]',
            "DMP principal passwords in clear on 0.0.0.0",
        ),
        (
            'protocol = "mtl"\nendpoint = "tcp:5555:interface=0.0.0.0"\nmechanisms = ["PLAIN"]',
            "SASL PLAIN passwords (no CURVE) in clear on 0.0.0.0",
        ),
    ],
)
def test_a_reachable_plaintext_listener_taking_passwords_is_warned_about(
    tmp_path: Path, table: str, what: str
) -> None:
    """Each listener that takes passwords in clear from other hosts gets one warning."""
    config = load_config(write(tmp_path, f"[listeners.exposed]\n{table}"))
    (warning,) = insecure_settings(config)
    assert warning.startswith(f"listener exposed: {what}")
    assert "use an mtls: endpoint or interface=127.0.0.1" in warning


@pytest.mark.parametrize(
    "table",
    [
        'protocol = "stream"\nendpoint = "tcp:5552:interface=127.0.0.1"',
        'protocol = "stream"\nendpoint = "tcp6:5552:interface=\\\\:\\\\:1"',
        'protocol = "stream"\nendpoint = "unix:/tmp/gw.sock"',
        'protocol = "stream"\nendpoint = "{mtls}"',
        'protocol = "ssmp"\nendpoint = "tcp:4000"\nschemes = ["open"]',
        'protocol = "qmqp"\nendpoint = "tcp:628"',
        'protocol = "dmp"\nendpoint = "tcp:5672"\nsinks = ["s"]',
        'protocol = "mtl"\nendpoint = "tcp:5555"\nmechanisms = ["PLAIN"]',
        'protocol = "mtl"\nendpoint = "tcp:5555:interface=0.0.0.0"\nmechanisms = ["SCRAM-SHA-256"]',
    ],
)
def test_loopback_tls_and_password_free_listeners_are_not_warned_about(
    tmp_path: Path, pki: Pki, table: str
) -> None:
    """Loopback, Unix sockets, TLS, and listeners that take no password in clear: no warning."""
    config = load_config(write(tmp_path, f"[listeners.quiet]\n{table.format(mtls=mtls(pki))}"))
    assert insecure_settings(config) == []


# --- relative key and certificate paths -------------------------------------------------


def test_relative_key_and_certificate_paths_are_the_main_files(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``certKey=pki/server.pem`` is next to the main file, wherever the gateway runs.

    Listeners, upstreams (``trustRoots``) and the admin endpoint alike; an
    absolute path is kept as written.
    """
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = "mtls:0:certKey=pki/server.pem:privateKey=pki/server.key:caCerts=pki/ca.pem"
    for name in ("server.pem", "server.key", "ca.pem"):
        assert (tmp_path / "pki" / name).is_file(), name  # where Pki put them
    main = write(
        tmp_path,
        f'[listeners.hub]\nprotocol = "ssmp"\nendpoint = "{relative}"\n'
        '[upstreams.far]\nprotocol = "ssmp"\nidentity = "gw"\nscheme = "open"\n'
        'endpoint = "tls:host=localhost:port=1:trustRoots=pki"\n'
        '[fleet]\namqp = ["tls:host=localhost:port=5671:trustRoots=pki"]\n',
    )
    config = load_config(main)
    [listener] = config.listeners
    base = tmp_path.resolve() / "pki"
    assert listener.endpoint == (
        f"mtls:0:certKey={base}/server.pem:privateKey={base}/server.key:caCerts={base}/ca.pem"
    )
    [upstream] = config.upstreams
    assert upstream.endpoint == f"tls:host=localhost:port=1:trustRoots={base}"
    assert config.fleet.amqp == (f"tls:host=localhost:port=5671:trustRoots={base}",)
    absolute = write(tmp_path, f'[listeners.hub]\nprotocol = "ssmp"\nendpoint = "{mtls(pki)}"\n')
    assert load_config(absolute).listeners[0].endpoint == mtls(pki)
