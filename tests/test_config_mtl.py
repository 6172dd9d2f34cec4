"""MTL configuration: SASL mechanisms and CURVE keys, listener and upstream."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.protocols.mtl.settings import MTLListenerSettings, MTLUpstreamSettings

LISTENER = """
[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
"""


def test_mechanisms_default_to_plain(tmp_path: Path) -> None:
    """Without the key, an MTL listener offers PLAIN only."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER)
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.mechanisms == ("PLAIN",)


def test_mechanisms_are_case_insensitive_and_ordered(tmp_path: Path) -> None:
    """``mechanisms`` keeps the order given (the 401 reply's), in capitals."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + 'mechanisms = ["scram-sha-256", "PLAIN"]\n')
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.mechanisms == ("SCRAM-SHA-256", "PLAIN")


@pytest.mark.parametrize("value", ['["CRAM-MD5"]', "[]", '["PLAIN", "GSSAPI"]'])
def test_unknown_or_no_mechanisms_name_the_key(tmp_path: Path, value: str) -> None:
    """An unknown mechanism, or none, is a config error naming file, key and the choices."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + f"mechanisms = {value}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    (problem,) = caught.value.problems
    assert (problem.file, problem.key) == (str(main), "listeners.mtl.mechanisms")
    assert "PLAIN, SCRAM-SHA-256" in problem.reason


def test_curve_secret_key_file_is_read_relative_to_the_config(tmp_path: Path) -> None:
    """``curve_secret_key_file`` names a file beside the config holding a Z85 key."""
    import zmq

    _, secret_key = zmq.curve_keypair()
    (tmp_path / "mtl.key").write_bytes(secret_key + b"\n")
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + 'curve_secret_key_file = "mtl.key"\n')
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.curve_secret_key == secret_key
    assert secret_key.decode() not in repr(listener.settings)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "cannot read"), (b"too short", "40 Z85 characters"), (b"~" * 40, "Z85")],
)
def test_bad_curve_secret_key_file(tmp_path: Path, content: bytes | None, reason: str) -> None:
    """A missing file or one without a Z85 key is a problem at the key."""
    if content is not None:
        (tmp_path / "mtl.key").write_bytes(content)
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + 'curve_secret_key_file = "mtl.key"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    (problem,) = caught.value.problems
    assert problem.key == "listeners.mtl.curve_secret_key_file"
    assert reason in problem.reason


UPSTREAM = """
[upstreams.far]
protocol = "mtl"
endpoint = "tcp:host=127.0.0.1:port=5555"
"""


def test_upstream_curve_server_key_and_mechanism(tmp_path: Path) -> None:
    """An upstream takes the server's Z85 public key and a SASL mechanism."""
    import zmq

    public_key, _ = zmq.curve_keypair()
    main = tmp_path / "gateway.toml"
    main.write_text(
        UPSTREAM + f'curve_server_key = "{public_key.decode()}"\nmechanism = "SCRAM-SHA-256"\n'
    )
    (upstream,) = load_config(main).upstreams
    assert isinstance(upstream.settings, MTLUpstreamSettings)
    assert upstream.settings.curve_server_key == public_key
    assert upstream.settings.mechanism == "SCRAM-SHA-256"


def test_bad_upstream_curve_server_key_and_mechanism(tmp_path: Path) -> None:
    """A key that is not Z85 and an unknown mechanism are each named."""
    main = tmp_path / "gateway.toml"
    main.write_text(UPSTREAM + 'curve_server_key = "nope"\nmechanism = "GSSAPI"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    keys = sorted(problem.key for problem in caught.value.problems)
    assert keys == ["upstreams.far.curve_server_key", "upstreams.far.mechanism"]


def test_allow_addresses_and_client_keys(tmp_path: Path) -> None:
    """Networks and Z85 client keys are taken as given on a CURVE listener."""
    import zmq

    client_key, _ = zmq.curve_keypair()
    _, secret_key = zmq.curve_keypair()
    (tmp_path / "mtl.key").write_bytes(secret_key)
    main = tmp_path / "gateway.toml"
    main.write_text(
        LISTENER
        + 'curve_secret_key_file = "mtl.key"\n'
        + f'curve_client_keys = ["{client_key.decode()}"]\n'
        + 'allow_addresses = ["127.0.0.1", "10.0.0.0/8", "::1/128"]\n'
    )
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.curve_client_keys == (client_key,)
    assert listener.settings.allow_addresses == ("127.0.0.1", "10.0.0.0/8", "::1/128")


def test_bad_allow_addresses_and_client_keys(tmp_path: Path) -> None:
    """A network that is not one, and client keys without CURVE, are named."""
    import zmq

    client_key, _ = zmq.curve_keypair()
    main = tmp_path / "gateway.toml"
    main.write_text(
        LISTENER
        + f'curve_client_keys = ["{client_key.decode()}"]\n'
        + 'allow_addresses = ["10.0.0.0/33"]\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    reasons = {problem.key: problem.reason for problem in caught.value.problems}
    assert sorted(reasons) == ["listeners.mtl.allow_addresses", "listeners.mtl.curve_client_keys"]
    assert "10.0.0.0/33" in reasons["listeners.mtl.allow_addresses"]
    assert "curve_secret_key_file" in reasons["listeners.mtl.curve_client_keys"]


def test_upstream_curve_secret_key_file(tmp_path: Path) -> None:
    """An upstream's own key file is read beside the config; without a server key it is refused."""
    import zmq

    server_key, _ = zmq.curve_keypair()
    _, secret_key = zmq.curve_keypair()
    (tmp_path / "client.key").write_bytes(secret_key)
    main = tmp_path / "gateway.toml"
    main.write_text(
        UPSTREAM
        + f'curve_server_key = "{server_key.decode()}"\n'
        + 'curve_secret_key_file = "client.key"\n'
    )
    (upstream,) = load_config(main).upstreams
    assert isinstance(upstream.settings, MTLUpstreamSettings)
    assert upstream.settings.curve_secret_key == secret_key
    main.write_text(UPSTREAM + 'curve_secret_key_file = "client.key"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    (problem,) = caught.value.problems
    assert problem.key == "upstreams.far.curve_secret_key_file"
    assert "curve_server_key" in problem.reason


def test_max_in_flight_is_read_and_defaults_to_ten_thousand(tmp_path: Path) -> None:
    """``max_in_flight`` reaches the listener's settings; without it, 10,000."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER)
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.max_in_flight == 10_000
    main.write_text(LISTENER + "max_in_flight = 250\n")
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.max_in_flight == 250


def test_max_in_flight_below_one_names_the_key(tmp_path: Path) -> None:
    """``max_in_flight = 0`` is a config error naming the key."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + "max_in_flight = 0\n")
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    (problem,) = caught.value.problems
    assert problem.key == "listeners.mtl.max_in_flight"
