"""The ``[fleet]`` table's RabbitMQ keys and the secrets file's ``[fleet]`` credentials."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.config.fleet import DEFAULT_HEARTBEAT_SECONDS, FleetConfig

HUB = """
[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
"""


def _load(tmp_path: Path, fleet: str, secrets: str | None = None) -> FleetConfig:
    """Load a main file with ``fleet`` as its ``[fleet]`` table (and a secrets file)."""
    main = f"[fleet]\n{textwrap.dedent(fleet)}\n{HUB}"
    if secrets is not None:
        (tmp_path / "secrets.toml").write_text(textwrap.dedent(secrets))
        main = '[gateway]\nsecrets = "secrets.toml"\n' + main
    path = tmp_path / "gateway.toml"
    path.write_text(main)
    return load_config(path).fleet


def _problems(tmp_path: Path, fleet: str, secrets: str | None = None) -> list[str]:
    """The problems, as ``key: reason``, of loading such a configuration."""
    with pytest.raises(ConfigError) as raised:
        _load(tmp_path, fleet, secrets)
    return [f"{problem.key}: {problem.reason}" for problem in raised.value.problems]


def test_without_amqp_there_is_no_backbone(tmp_path: Path) -> None:
    """A ``[fleet]`` table with only a node id has no endpoints: a fleet of one."""
    fleet = _load(tmp_path, 'node = "a"')
    assert fleet == FleetConfig(node="a")
    assert fleet.amqp == ()
    assert fleet.heartbeat_seconds == DEFAULT_HEARTBEAT_SECONDS


def test_one_endpoint_as_a_string(tmp_path: Path) -> None:
    """``amqp`` may be one endpoint string."""
    fleet = _load(tmp_path, 'amqp = "tcp:host=127.0.0.1:port=5672"')
    assert fleet.amqp == ("tcp:host=127.0.0.1:port=5672",)
    assert fleet.vhost == "/"


def test_a_list_of_endpoints_in_order(tmp_path: Path) -> None:
    """A cluster's endpoints are kept in the order written (tried in turn)."""
    fleet = _load(
        tmp_path,
        """
        amqp = ["tcp:host=r1:port=5672", "tls:host=r2:port=5671"]
        vhost = "gateways"
        heartbeat_seconds = 4
        """,
    )
    assert fleet.amqp == ("tcp:host=r1:port=5672", "tls:host=r2:port=5671")
    assert (fleet.vhost, fleet.heartbeat_seconds) == ("gateways", 4.0)


@pytest.mark.parametrize(
    ("fleet", "expected"),
    [
        ('amqp = "nonsense:x"', "fleet.amqp: bad client endpoint 'nonsense:x'"),
        ('amqp = "ssl:host=r1:port=5671"', "fleet.amqp: ssl: does not verify the server"),
        ("amqp = []", "fleet.amqp: must name at least one endpoint"),
        ("amqp = 5672", "fleet.amqp: must be a list of strings"),
        ('amqp = "tcp:host=r:port=1"\nvhost = ""', "fleet.vhost: must not be empty"),
        ('amqp = "tcp:host=r:port=1"\nheartbeat_seconds = 0', "fleet.heartbeat_seconds: must"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, fleet: str, expected: str) -> None:
    """Each bad value is a problem naming ``fleet.<key>`` and what is wrong."""
    problems = _problems(tmp_path, fleet)
    assert any(problem.startswith(expected) for problem in problems), problems


def test_credentials_come_from_the_secrets_file(tmp_path: Path) -> None:
    """The secrets file's ``[fleet]`` table holds the RabbitMQ user and password."""
    main = tmp_path / "gateway.toml"
    (tmp_path / "secrets.toml").write_text('[fleet]\nusername = "gw"\npassword = "pw"\n')
    main.write_text(
        '[gateway]\nsecrets = "secrets.toml"\n[fleet]\namqp = "tcp:host=r:port=1"\n' + HUB
    )
    secrets = load_config(main).secrets
    assert (secrets.fleet_username, secrets.fleet_password) == ("gw", b"pw")


def test_a_user_without_password_is_a_problem(tmp_path: Path) -> None:
    """A user name without its password (or the reverse) names the missing key."""
    problems = _problems(tmp_path, 'amqp = "tcp:host=r:port=1"', '[fleet]\nusername = "gw"\n')
    assert problems == [
        "fleet.password: username and password go together: give both, or neither (guest)"
    ]


def test_health_and_pinned_streams(tmp_path: Path) -> None:
    """``unhealthy_after_seconds`` (10 by default) and ``[fleet.streams]`` pins, sorted."""
    assert _load(tmp_path, 'node = "a"').unhealthy_after_seconds == 10.0
    fleet = _load(
        tmp_path,
        """
        unhealthy_after_seconds = 2.5
        [fleet.streams]
        "ticks" = "edge-2"
        "orders" = "edge-1"
        """,
    )
    assert fleet.unhealthy_after_seconds == 2.5
    assert fleet.streams == (("orders", "edge-1"), ("ticks", "edge-2"))


def test_a_stream_pinned_to_no_node_id_is_a_problem(tmp_path: Path) -> None:
    """A pin's value must be a node id; a threshold must be positive."""
    problems = _problems(tmp_path, '[fleet.streams]\n"orders" = "not a node"')
    assert problems == [
        "fleet.streams.orders: the node that owns the stream must be ASCII letters, digits,"
        " '-', '_' and '.', starting with a letter or a digit, not 'not a node'"
    ]
    assert _problems(tmp_path, "unhealthy_after_seconds = 0")[0].startswith(
        "fleet.unhealthy_after_seconds: must"
    )


DMP = """
[gateway]
secrets = "secrets.toml"

[fleet]
amqp = "tcp:host=127.0.0.1:port=5672"
{admin}
[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]
{principals}
"""


def _dmp_fleet(tmp_path: Path, secrets: str, admin: str = "", principals: str = "") -> Path:
    """A fleet node with a DMP listener; its main file."""
    (tmp_path / "secrets.toml").write_text(secrets)
    path = tmp_path / "gateway.toml"
    path.write_text(DMP.format(admin=admin, principals=principals))
    return path


def test_a_fleet_that_makes_dmp_leases_needs_a_lease_secret(tmp_path: Path) -> None:
    """Admin endpoint and a DMP listener in a fleet, no lease_secret: the secrets file's key."""
    path = _dmp_fleet(tmp_path, 'admin_token = "a-token"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    [problem] = raised.value.problems
    assert problem.file == str(tmp_path / "secrets.toml")
    assert problem.key == "fleet.lease_secret"
    assert "'dmp' make leases at run time" in problem.reason


def test_a_short_lease_secret_is_a_problem(tmp_path: Path) -> None:
    """A lease secret under 32 characters is refused, naming the key."""
    path = _dmp_fleet(tmp_path, '[fleet]\nlease_secret = "short"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    keys = [problem.key for problem in raised.value.problems]
    assert keys[0] == "fleet.lease_secret" and "at least 32" in raised.value.problems[0].reason


def test_the_lease_secret_is_read_and_needed_only_where_leases_are_made(tmp_path: Path) -> None:
    """With it, it is kept; without the admin endpoint or principals, none is needed."""
    secret = "0123456789abcdef0123456789abcdef"
    config = load_config(_dmp_fleet(tmp_path, f'[fleet]\nlease_secret = "{secret}"\n'))
    assert config.secrets.fleet_lease_secret == secret.encode()
    quiet = _dmp_fleet(tmp_path, "", admin="[admin]\nenabled = false\n")
    assert load_config(quiet).secrets.fleet_lease_secret is None
    with pytest.raises(ConfigError, match=r"fleet\.lease_secret"):
        load_config(
            _dmp_fleet(
                tmp_path, "", admin="[admin]\nenabled = false\n", principals='principals = ["app"]'
            )
        )
