"""SSMP ``LOGIN alice/x cert`` through the TLS front-end works with a msggateway backend (13d).

docs/tls.rst says the front-end takes ``LOGIN <id> cert`` with ``<id>`` a
certificate name optionally followed by ``/suffix`` (several connections
with one certificate), and logs in to the backend as ``<id>`` with the
secret of the certificate name. A msggateway backend refused it: it looked
up a secret for ``alice/x`` itself. A backend's ``secret`` login as
``name/suffix`` now takes ``name``'s secret (and the connection is ``name``
for allow-lists), while a wrong secret, or another name's, is still ``401``.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import pytest

from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

BACKEND = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["secret"]
login_failure_delay_seconds = 0  # refusals answered at once: this test refuses on purpose

[listeners.hub.authorize.alice]
publish = ["news"]

[listeners.hub.authorize.bob]
consume = ["news"]
"""
BACKEND_SECRETS = """
[logins]
alice = "alice-at-the-backend"
bob = "bob-secret"
"""
FRONT = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.front]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={hub}"
"""
FRONT_SECRETS = """
[frontends.front]
alice = "alice-at-the-backend"
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A plaintext msggateway SSMP hub with secret logins and allow-lists."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("backend"), BACKEND, secrets=BACKEND_SECRETS
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def front(
    pki: Pki, backend: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The TLS front-end of the hub."""
    config = FRONT.format(tls=mtls_endpoint(pki), hub=backend.address("hub")[1])
    process = GatewayProcess(
        tmp_path_factory.mktemp("front"), config, secrets=FRONT_SECRETS
    ).start()
    yield process
    process.stop()


def _alice(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    return ctx


def test_two_suffixed_logins_through_the_front_end(
    front: GatewayProcess, backend: GatewayProcess, pki: Pki
) -> None:
    """``alice/phone`` and ``alice/laptop`` both log in; each MCAST reaches bob under its id."""
    with LineClient(backend.address("hub")) as bob:
        bob.send("LOGIN bob secret bob-secret", "SUBSCRIBE news")
        assert bob.read_lines(2) == [b"200", b"200"]
        with (
            LineClient(front.address("front"), _alice(pki)) as phone,
            LineClient(front.address("front"), _alice(pki)) as laptop,
        ):
            phone.send("LOGIN alice/phone cert")
            phone.expect("200")
            laptop.send("LOGIN alice/laptop cert")
            laptop.expect("200")
            phone.send("MCAST news from-the-phone")
            phone.expect("200")  # alice may publish to news: the principal is alice
            laptop.send("MCAST news from-the-laptop")
            laptop.expect("200")
            assert sorted(bob.read_lines(2)) == [
                b"000 alice/laptop MCAST news from-the-laptop",
                b"000 alice/phone MCAST news from-the-phone",
            ]


@pytest.mark.parametrize(
    ("login", "reply"),
    [
        ("LOGIN alice/x secret alice-at-the-backend", b"200"),
        ("LOGIN alice/x secret wrong", b"401 secret"),
        ("LOGIN bob/x secret alice-at-the-backend", b"401 secret"),
        ("LOGIN alice/ secret alice-at-the-backend", b"401 secret"),
        ("LOGIN carol/x secret alice-at-the-backend", b"401 secret"),
    ],
)
def test_a_suffixed_secret_login_takes_the_names_secret_only(
    backend: GatewayProcess, login: str, reply: bytes
) -> None:
    """Directly at the backend: ``name/suffix`` takes ``name``'s secret, and nobody else's."""
    with LineClient(backend.address("hub")) as client:
        client.send(login)
        assert client.read_line() == reply
