"""Tests for the ``authorize`` tables of listeners in `gateway.config`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.core.authorization import UNRESTRICTED


def _write(path: Path, text: str) -> Path:
    """Write dedented text to a file; return the path."""
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_listener_without_authorize_is_unrestricted(tmp_path: Path) -> None:
    """No ``authorize`` table keeps today's behaviour: everything allowed."""
    config = load_config(
        _write(
            tmp_path / "gateway.toml",
            """
            [listeners.hub]
            protocol = "ssmp"
            endpoint = "tcp:0:interface=127.0.0.1"
            """,
        )
    )
    assert config.listeners[0].authorization is UNRESTRICTED


def test_authorize_tables_are_read(tmp_path: Path) -> None:
    """Each identity's publish and consume patterns become the listener's allow-lists."""
    config = load_config(
        _write(
            tmp_path / "gateway.toml",
            """
            [listeners.hub]
            protocol = "ssmp"
            endpoint = "tcp:0:interface=127.0.0.1"

            [listeners.hub.authorize.alice]
            publish = ["orders", "weather.*"]
            consume = ["orders"]

            [listeners.hub.authorize."*"]
            consume = ["public.#"]
            """,
        )
    )
    authz = config.listeners[0].authorization
    assert authz.restricted
    assert authz.may_publish("alice", "weather.paris")
    assert not authz.may_consume("alice", "weather.paris")
    assert authz.may_consume("bob", "public.x")
    assert not authz.may_publish("bob", "orders")


@pytest.mark.parametrize(
    ("body", "key", "fragment"),
    [
        ('publish = ["news*"]', "listeners.hub.authorize.alice.publish", "mixes wildcards"),
        ('consume = "orders"', "listeners.hub.authorize.alice.consume", "a list of strings"),
        ('subscribe = ["x"]', "listeners.hub.authorize.alice.subscribe", "unknown key"),
    ],
)
def test_bad_authorize_entries_name_their_key(
    tmp_path: Path, body: str, key: str, fragment: str
) -> None:
    """A bad pattern, a wrong type or a typo is reported with file, key and reason."""
    path = _write(
        tmp_path / "gateway.toml",
        f"""
        [listeners.hub]
        protocol = "ssmp"
        endpoint = "tcp:0:interface=127.0.0.1"

        [listeners.hub.authorize.alice]
        {body}
        """,
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    problems = caught.value.problems
    assert [(p.file, p.key) for p in problems] == [(str(path), key)]
    assert fragment in problems[0].reason


def test_authorize_entry_must_be_a_table(tmp_path: Path) -> None:
    """``authorize.alice = [...]`` is refused: each identity is a table."""
    path = _write(
        tmp_path / "gateway.toml",
        """
        [listeners.hub]
        protocol = "ssmp"
        endpoint = "tcp:0:interface=127.0.0.1"
        authorize = { alice = ["orders"] }
        """,
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert [p.key for p in caught.value.problems] == ["listeners.hub.authorize.alice"]


MTL_LISTENER = """
[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
mechanisms = ["EXTERNAL", "PLAIN"]
"""


def test_mtl_curve_identities_for_external(tmp_path: Path) -> None:
    """``curve_identities`` maps identities to Z85 keys; EXTERNAL may then be offered."""
    import zmq

    client_key, _ = zmq.curve_keypair()
    _, secret_key = zmq.curve_keypair()
    (tmp_path / "mtl.key").write_bytes(secret_key)
    main = tmp_path / "gateway.toml"
    main.write_text(
        MTL_LISTENER
        + 'curve_secret_key_file = "mtl.key"\n'
        + f'[listeners.mtl.curve_identities]\nalice = "{client_key.decode()}"\n'
    )
    (listener,) = load_config(main).listeners
    assert listener.settings.mechanisms == ("EXTERNAL", "PLAIN")
    assert dict(listener.settings.curve_identities) == {"alice": client_key}


def test_mtl_external_needs_identities_and_curve(tmp_path: Path) -> None:
    """EXTERNAL without identities, and identities without CURVE or with a bad key, are named."""
    main = tmp_path / "gateway.toml"
    main.write_text(MTL_LISTENER + '[listeners.mtl.curve_identities]\nbob = "nope"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    keys = sorted(problem.key for problem in caught.value.problems)
    assert keys == ["listeners.mtl.curve_identities.bob", "listeners.mtl.mechanisms"]
    main.write_text(MTL_LISTENER.replace('"EXTERNAL", ', ""))
    load_config(main)  # PLAIN alone needs none of it


def test_dmp_lease_bound_to_an_identity(tmp_path: Path) -> None:
    """A DMP lease's ``identity`` binds it; without one it is anyone's."""
    main = _write(
        tmp_path / "gateway.toml",
        """
        [listeners.dmp]
        protocol = "dmp"
        endpoint = "tcp:0:interface=127.0.0.1"
        sinks = ["orders"]

        [listeners.dmp.leases.alice]
        sink = "orders"
        text = "A"
        identity = "alice"

        [listeners.dmp.leases.open]
        sink = "orders"
        text = "O"
        """,
    )
    leases = load_config(main).listeners[0].settings.leases
    assert (leases["alice"].identity, leases["alice"].certified) == ("alice", True)
    assert leases["open"].identity is None
