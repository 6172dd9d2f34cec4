"""Tests for `gateway.config`: TOML files in, frozen validated objects out.

Every configuration is written into pytest's ``tmp_path``; the embedded
default and the repository's example in ``etc/`` are checked as shipped.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import attrs
import pytest
from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor, MemoryReactorClock

from gateway.config import (
    DEFAULT_CONFIG_NAME,
    AdminConfig,
    ConfigError,
    ConfigProblem,
    GatewayConfig,
    ListenerConfig,
    UpstreamConfig,
    load_config,
    load_default_config,
    reload_routes,
)
from gateway.config.gateway import DEFAULT_SHUTDOWN_GRACE_SECONDS
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.flow import FlowPolicy
from gateway.core.router import Route
from gateway.protocols.ssmp.settings import SSMPListenerSettings, SSMPUpstreamSettings

REPOSITORY = Path(__file__).parents[1]

HUB = """
    [listeners.hub]
    protocol = "ssmp"
    endpoint = "tcp:0:interface=127.0.0.1"
"""
"""A minimal valid listener, for tests that break something else."""

CENTRAL = """
    [upstreams.central]
    protocol = "ssmp"
    endpoint = "tcp:host=127.0.0.1:port=9787"
    identity = "gateway-1"
    scheme = "open"
"""
"""A minimal valid upstream that needs no secret."""


def _write(path: Path, text: str) -> Path:
    """Write dedented text to a file, creating its directory; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _problems(path: Path) -> list[ConfigProblem]:
    """Load a config that must be invalid; return every problem reported."""
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == "\n".join(map(str, caught.value.problems))
    return caught.value.problems


def _the_problem(
    problems: list[ConfigProblem], file: Path, key: str, *fragments: str
) -> ConfigProblem:
    """Return the one problem reported for ``file`` and ``key``; check its reason."""
    found = [p for p in problems if p.file == str(file) and p.key == key]
    assert len(found) == 1, f"expected one problem at {file}: {key}, got {problems}"
    for fragment in fragments:
        assert fragment in found[0].reason, found[0]
    return found[0]


def _only_problem(path: Path, key: str, *fragments: str, file: Path | None = None) -> None:
    """Load an invalid config and check that it has exactly this one problem."""
    problems = _problems(path)
    assert len(problems) == 1, problems
    _the_problem(problems, file or path, key, *fragments)


def _full_tree(directory: Path) -> Path:
    """Write a complete valid configuration; return its main file."""
    _write(
        directory / "secrets.toml",
        """
        [logins]
        alice = "a-secret"
        "*" = "shared"
        [upstreams]
        central = "gw-secret"
        """,
    )
    _write(
        directory / "routes" / "weather-to-central.toml",
        """
        description = "local weather to the central hub"
        from = "hub"
        match = "weather.#"
        to = "central"
        address = "central.{1}"
        timeout_seconds = 5
        """,
    )
    _write(
        directory / "routes" / "alerts-from-central.toml",
        """
        from = "central"
        match = "alerts"
        to = "hub"
        """,
    )
    _write(directory / "routes" / "README.txt", "not a route: only *.toml files are\n")
    return _write(
        directory / "gateway.toml",
        """
        [gateway]
        data_dir = "state"
        routes = "routes"
        secrets = "secrets.toml"
        shutdown_grace_seconds = 2.5

        [admin]
        endpoint = "tcp:0:interface=127.0.0.1"

        [listeners.hub]
        protocol = "ssmp"
        endpoint = "tcp:0:interface=127.0.0.1"
        schemes = ["secret", "open"]
        anonymous = true
        login_timeout_seconds = 5
        ping_interval_seconds = 20.5
        pong_timeout_seconds = 10
        max_backlog_bytes = 65536
        slow_consumer_policy = "disconnect"
        slow_consumer_seconds = 2.5
        max_pending_replies = 10

        [listeners.side]
        protocol = "ssmp"
        endpoint = "tcp:0"

        [upstreams.central]
        protocol = "ssmp"
        endpoint = "tcp:host=127.0.0.1:port=9787"
        identity = "gateway-1"
        subscribe = ["news", "sports"]
        presence = true
        ping_interval_seconds = 15
        max_in_flight = 5
        """,
    )


# --- valid configurations ----------------------------------------------------------------


def test_full_config_loads_into_frozen_objects(tmp_path: Path) -> None:
    """Every section becomes its frozen object; relative paths follow the main file."""
    main = _full_tree(tmp_path / "conf")
    config = load_config(main)
    assert config.source == str(main)
    assert config.listeners == (
        ListenerConfig(
            name="hub",
            protocol="ssmp",
            endpoint="tcp:0:interface=127.0.0.1",
            settings=SSMPListenerSettings(
                schemes=frozenset({"secret", "open"}),
                anonymous=True,
                login_timeout_seconds=5.0,
                ping_interval_seconds=20.5,
                pong_timeout_seconds=10.0,
                max_pending_replies=10,
            ),
            flow=FlowPolicy(
                policy="disconnect", slow_consumer_seconds=2.5, max_backlog_bytes=65536
            ),
        ),
        ListenerConfig(
            name="side", protocol="ssmp", endpoint="tcp:0", settings=SSMPListenerSettings()
        ),
    )
    assert config.upstreams == (
        UpstreamConfig(
            name="central",
            protocol="ssmp",
            endpoint="tcp:host=127.0.0.1:port=9787",
            settings=SSMPUpstreamSettings(
                identity="gateway-1",
                scheme="secret",
                subscribe=("news", "sports"),
                presence=True,
                ping_interval_seconds=15.0,
                max_in_flight=5,
            ),
        ),
    )
    assert config.routes == (
        Route(
            name="alerts-from-central",
            source="central",
            pattern=AddressPattern("alerts"),
            destination="hub",
        ),
        Route(
            name="weather-to-central",
            source="hub",
            pattern=AddressPattern("weather.#"),
            destination="central",
            target=AddressTemplate("central.{1}"),
            timeout_seconds=5.0,
        ),
    )
    assert config.admin == AdminConfig("tcp:0:interface=127.0.0.1")
    assert config.secrets == Secrets(
        logins={"alice": b"a-secret", "*": b"shared"}, upstreams={"central": b"gw-secret"}
    )
    assert config.secrets.verify("carol", b"shared")
    assert config.data_dir == tmp_path / "conf" / "state"
    assert config.routes_dir == tmp_path / "conf" / "routes"
    assert config.secrets_path == tmp_path / "conf" / "secrets.toml"
    assert config.shutdown_grace_seconds == 2.5
    assert config.endpoint_names() == {"hub": "ssmp", "side": "ssmp", "central": "ssmp"}


def test_config_objects_are_frozen(tmp_path: Path) -> None:
    """A loaded configuration cannot be changed in place; loading twice gives equal values."""
    main = _full_tree(tmp_path)
    config = load_config(main)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.listeners = ()  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.listeners[0].endpoint = "tcp:1"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.routes[0].timeout_seconds = 1  # type: ignore[misc]
    assert load_config(main) == config


def test_minimal_config_uses_defaults(tmp_path: Path) -> None:
    """Without optional sections: admin on loopback 8790, no routes, no secrets."""
    config = load_config(_write(tmp_path / "gateway.toml", HUB))
    assert config.admin == AdminConfig("tcp:8790:interface=127.0.0.1")
    assert config.upstreams == ()
    assert config.routes == ()
    assert config.routes_dir is None
    assert config.secrets_path is None
    assert config.secrets == Secrets()
    assert config.data_dir == tmp_path / "var"
    assert config.shutdown_grace_seconds == DEFAULT_SHUTDOWN_GRACE_SECONDS
    assert config.listeners[0].settings == SSMPListenerSettings()


def test_admin_can_be_disabled(tmp_path: Path) -> None:
    """``enabled = false`` turns the admin endpoint off."""
    main = _write(tmp_path / "gateway.toml", HUB + "\n[admin]\nenabled = false\n")
    config = load_config(main)
    assert config.admin == AdminConfig(None)
    assert config.summary().endswith("admin off")


def test_embedded_default_listens_on_loopback() -> None:
    """The default on loopback: SSMP 8787, QMQP 8628, stream 5552, DMP 5554, MTL 5555, admin."""
    config = load_default_config()
    assert config.source == DEFAULT_CONFIG_NAME
    assert config.upstreams == ()
    routes = {route.name: route for route in config.routes}
    mail = routes["mail-to-ssmp"]
    assert (mail.source, mail.destination, mail.body) == ("qmqp", "ssmp", "subject")
    assert (routes["dmp-demo"].source, routes["dmp-demo"].destination) == ("dmp", "dmp")
    ssmp_listener, qmqp_listener, stream_listener, dmp_listener, mtl_listener = config.listeners
    assert mtl_listener.protocol == "mtl" and mtl_listener.settings.data_port == 5556
    assert stream_listener.protocol == "stream"
    assert stream_listener.settings.guest
    assert config.log.fsync == "always"
    assert ssmp_listener.protocol == "ssmp"
    assert not ssmp_listener.tls
    assert ssmp_listener.settings.schemes == frozenset({"open"})
    assert ssmp_listener.settings.anonymous
    assert qmqp_listener.protocol == "qmqp"
    assert dmp_listener.protocol == "dmp"
    assert dmp_listener.settings.sinks == dmp_listener.settings.feeds == frozenset({"demo"})

    reactor = MemoryReactor()
    endpoints = (ssmp_listener, qmqp_listener, stream_listener, dmp_listener)
    for endpoint in (*(listener.endpoint for listener in endpoints), config.admin.endpoint):
        assert endpoint is not None
        serverFromString(reactor, endpoint).listen(Factory.forProtocol(Protocol))
    assert [(port, interface) for port, _, _, interface in reactor.tcpServers] == [
        (8787, "127.0.0.1"),
        (8628, "127.0.0.1"),
        (5552, "127.0.0.1"),
        (5554, "127.0.0.1"),
        (8790, "127.0.0.1"),
    ]
    assert mtl_listener.endpoint == "tcp:5555:interface=127.0.0.1"  # ZeroMQ binds it


def test_repository_example_is_valid() -> None:
    """``etc/gateway.toml``, the example operators start from, loads without problems."""
    config = load_config(REPOSITORY / "etc" / "gateway.toml")
    assert [listener.name for listener in config.listeners] == ["hub", "mail"]
    assert [upstream.name for upstream in config.upstreams] == ["central"]
    assert [route.name for route in config.routes] == [
        "alerts-from-central",
        "mail-alerts",
        "weather-to-central",
    ]
    assert config.secrets.credential_for("central") is not None


def test_repository_example_runs_beside_the_embedded_default() -> None:
    """etc/gateway.toml is easy to try: own ports, a data dir that works, a central that answers.

    Its listeners and admin endpoint share no port with the embedded default's;
    its data dir is absolute (``../var`` became /etc/var once copied to
    /etc/msggateway, read-only under the unit's sandbox) and is where the unit
    lets the gateway write; its ``central`` upstream is the default's SSMP hub
    with a scheme that hub takes (before: 127.0.0.1:9787, nothing there).
    """
    example = load_config(REPOSITORY / "etc" / "gateway.toml")
    default = load_default_config()

    def ports(config: GatewayConfig) -> set[int]:
        found = {int(str(listener.endpoint).split(":")[1]) for listener in config.listeners}
        assert config.admin.endpoint is not None
        return found | {int(config.admin.endpoint.split(":")[1])}

    assert ports(example).isdisjoint(ports(default))
    assert example.data_dir == Path("/var/lib/msggateway")
    unit = (REPOSITORY / "etc" / "msggateway.service").read_text()
    assert f"ReadWritePaths={example.data_dir}\n" in unit
    [central] = example.upstreams
    [hub] = [listener for listener in default.listeners if listener.protocol == "ssmp"]
    assert central.endpoint == "tcp:host=127.0.0.1:port=" + hub.endpoint.split(":")[1]
    assert central.settings.scheme in hub.settings.schemes


def test_summary_is_one_line(tmp_path: Path) -> None:
    """`GatewayConfig.summary` names the source and counts everything, on one line."""
    config = load_config(_full_tree(tmp_path))
    summary = config.summary()
    assert "\n" not in summary
    assert summary == (
        f"{tmp_path / 'gateway.toml'}: OK: 2 listener(s) [hub (ssmp), side (ssmp)],"
        " 1 upstream(s) [central (ssmp)], 2 route(s), admin on tcp:0:interface=127.0.0.1"
    )
    empty = GatewayConfig("x", (), (), (), AdminConfig(None))
    assert empty.summary() == (
        "x: OK: 0 listener(s) [none], 0 upstream(s) [none], 0 route(s), admin off"
    )


# --- files ----------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    """A main file that does not exist is reported as such."""
    _only_problem(tmp_path / "nowhere.toml", "-", "file not found")


def test_toml_syntax_error(tmp_path: Path) -> None:
    """A TOML syntax error is reported with the parser's line and column."""
    main = _write(tmp_path / "gateway.toml", '[gateway]\nroutes "routes"\n')
    _only_problem(main, "-", "not valid TOML", "line 2")


def test_missing_secrets_file(tmp_path: Path) -> None:
    """A secrets file named but absent is reported under its own path."""
    main = _write(tmp_path / "gateway.toml", '[gateway]\nsecrets = "secrets.toml"\n' + HUB)
    _only_problem(main, "-", "file not found", file=tmp_path / "secrets.toml")


def test_missing_routes_directory(tmp_path: Path) -> None:
    """A routes directory named but absent is reported."""
    main = _write(tmp_path / "gateway.toml", '[gateway]\nroutes = "routes"\n' + HUB)
    _only_problem(main, "-", "routes directory not found", file=tmp_path / "routes")


# --- keys and types -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        (HUB + 'endpiont = "tcp:1"\n', "listeners.hub.endpiont", "did you mean 'endpoint'?"),
        (HUB + "schemas = []\n", "listeners.hub.schemas", "did you mean 'schemes'?"),
        (HUB.replace("[listeners.hub]", "[listener.hub]"), "listener", "did you mean 'listeners'?"),
        ('[gateway]\nroute = "routes"\n' + HUB, "gateway.route", "did you mean 'routes'?"),
        ("[admin]\nendpoints = 'tcp:0'\n" + HUB, "admin.endpoints", "did you mean 'endpoint'?"),
    ],
)
def test_unknown_key_suggests_the_known_one(tmp_path: Path, text: str, key: str, hint: str) -> None:
    """A misspelt key is reported with the closest known key and the list of known ones."""
    problems = _problems(_write(tmp_path / "gateway.toml", text))
    problem = _the_problem(problems, tmp_path / "gateway.toml", key, "unknown key", hint)
    assert "known here:" in problem.reason


@pytest.mark.parametrize(
    ("setting", "key", "reason"),
    [
        (
            'login_timeout_seconds = "10"',
            "login_timeout_seconds",
            "must be a number, not a string ('10')",
        ),
        (
            "ping_interval_seconds = true",
            "ping_interval_seconds",
            "must be a number, not a boolean",
        ),
        ("max_backlog_bytes = true", "max_backlog_bytes", "must be a whole number, not a boolean"),
        ('max_backlog_bytes = "4MiB"', "max_backlog_bytes", "must be a whole number, not a string"),
        ("max_pending_replies = 1.5", "max_pending_replies", "must be a whole number"),
        ("slow_consumer_seconds = true", "slow_consumer_seconds", "must be a number"),
        ('anonymous = "yes"', "anonymous", "must be true or false, not a string ('yes')"),
        ('schemes = "open"', "schemes", "must be a list of strings, not a string"),
        ("schemes = [1]", "schemes", "must hold only strings, not a number (1)"),
        ("endpoint = 8787", "endpoint", "must be a string, not a number (8787)"),
    ],
)
def test_wrong_types(tmp_path: Path, setting: str, key: str, reason: str) -> None:
    """A value of the wrong type is reported with what was expected and what was found."""
    if key == "endpoint":
        text = '[listeners.hub]\nprotocol = "ssmp"\n' + setting + "\n"
    else:
        text = HUB + setting + "\n"
    main = _write(tmp_path / "gateway.toml", text)
    _only_problem(main, f"listeners.hub.{key}", reason)


@pytest.mark.parametrize(
    ("setting", "key", "reason"),
    [
        ("login_timeout_seconds = 0", "login_timeout_seconds", "must be greater than 0, not 0"),
        ("login_timeout_seconds = -1", "login_timeout_seconds", "must be greater than 0, not -1"),
        ("ping_interval_seconds = -0.5", "ping_interval_seconds", "must be greater than 0"),
        ("pong_timeout_seconds = 0.0", "pong_timeout_seconds", "must be greater than 0"),
        ("max_backlog_bytes = 1024", "max_backlog_bytes", "must be at least 65536, not 1024"),
        ("max_pending_replies = 0", "max_pending_replies", "must be at least 1, not 0"),
        ("slow_consumer_seconds = -1", "slow_consumer_seconds", "must be at least 0, not -1"),
        (
            'slow_consumer_policy = "drop"',
            "slow_consumer_policy",
            "must be one of disconnect, pause-producers, not 'drop'",
        ),
    ],
)
def test_out_of_range_numbers(tmp_path: Path, setting: str, key: str, reason: str) -> None:
    """Zero or negative time-outs and too small limits are refused with the bound."""
    main = _write(tmp_path / "gateway.toml", HUB + setting + "\n")
    _only_problem(main, f"listeners.hub.{key}", reason)


def test_a_negative_shutdown_grace_is_refused(tmp_path: Path) -> None:
    """``shutdown_grace_seconds`` may be 0 (close at once), never below."""
    main = _write(tmp_path / "gateway.toml", "[gateway]\nshutdown_grace_seconds = -1\n" + HUB)
    _only_problem(main, "gateway.shutdown_grace_seconds", "must be at least 0, not -1")
    zero = _write(tmp_path / "zero.toml", "[gateway]\nshutdown_grace_seconds = 0\n" + HUB)
    assert load_config(zero).shutdown_grace_seconds == 0.0


def test_required_keys(tmp_path: Path) -> None:
    """A listener without protocol or endpoint says which is required."""
    main = _write(tmp_path / "gateway.toml", "[listeners.hub]\n")
    problems = _problems(main)
    assert len(problems) == 2, problems
    _the_problem(problems, main, "listeners.hub.protocol", "is required")
    _the_problem(problems, main, "listeners.hub.endpoint", "is required (a string)")


def test_unknown_protocol(tmp_path: Path) -> None:
    """An unknown protocol lists the known ones, without blaming its other keys."""
    main = _write(
        tmp_path / "gateway.toml",
        HUB.replace('protocol = "ssmp"', 'protocol = "smtp"\n    schemes = ["open"]'),
    )
    _only_problem(
        main,
        "listeners.hub.protocol",
        "must be one of dmp, frontend, mtl, qmqp, ssmp, stream, not 'smtp'",
    )


def test_mtl_upstream_on_the_test_profile_must_not_ask_for_confirmations(
    tmp_path: Path,
) -> None:
    """The test profile never confirms: confirm = "full" (the default) is named as the problem."""
    text = '[upstreams.far]\nprotocol = "mtl"\nendpoint = "tcp:host=127.0.0.1:port=5555"\n'
    main = _write(tmp_path / "gateway.toml", text + 'profile = "test"\n')
    _only_problem(main, "upstreams.far.confirm", "the test profile never confirms")
    fine = _write(tmp_path / "fine.toml", text + 'profile = "TEST"\nconfirm = "none"\n')
    (upstream,) = load_config(fine).upstreams
    assert (upstream.settings.profile, upstream.settings.confirm) == ("test", "none")


def test_missing_endpoint_does_not_blame_protocol_settings(tmp_path: Path) -> None:
    """Without an endpoint, the protocol's own settings are not called unknown keys."""
    main = _write(
        tmp_path / "gateway.toml",
        '[listeners.hub]\nprotocol = "ssmp"\nschemes = ["open"]\nanonymous = true\n',
    )
    _only_problem(main, "listeners.hub.endpoint", "is required")


@pytest.mark.parametrize(
    ("section", "endpoint", "reason"),
    [
        ("listeners.hub", "tcp:notaport", "port must be a whole number, not 'notaport'"),
        ("listeners.hub", "tcp:port=87x", "port must be a whole number, not '87x'"),
        ("listeners.hub", "tcp:8787:backlog=x", "backlog must be a whole number, not 'x'"),
        ("listeners.hub", "tcp:8787:bogus=1", "unknown parameter 'bogus'"),
        ("listeners.hub", "tcp:70000", "port 70000 is past 65535"),
        ("upstreams.central", "tcp:host=x:port=9787x", "port must be a whole number, not '9787x'"),
        ("upstreams.central", "tcp:host=x:port=1:bogus=2", "unknown parameter 'bogus'"),
        ("upstreams.central", "tcp:x", "port is missing"),
        ("upstreams.central", "tcp:host=x:port=99999", "port 99999 is past 65535"),
    ],
)
def test_bad_endpoint_strings(tmp_path: Path, section: str, endpoint: str, reason: str) -> None:
    """An endpoint string Twisted cannot parse is reported naming the field, in plain words.

    Not Python's own messages from inside Twisted's parser (``invalid
    literal for int() with base 10``, ``__init__() missing 1 required
    positional argument``), and not a port a socket cannot have.
    """
    if section.startswith("listeners"):
        text = HUB.replace("tcp:0:interface=127.0.0.1", endpoint) + CENTRAL
    else:
        text = HUB + CENTRAL.replace("tcp:host=127.0.0.1:port=9787", endpoint)
    main = _write(tmp_path / "gateway.toml", text)
    kind = "server" if section.startswith("listeners") else "client"
    _only_problem(main, f"{section}.endpoint", f"bad {kind} endpoint {endpoint!r}: {reason}")
    [problem] = _problems(main)
    assert problem.reason == f"bad {kind} endpoint {endpoint!r}: {reason}"


def test_bad_admin_endpoint(tmp_path: Path) -> None:
    """The admin endpoint is checked like a listener's."""
    main = _write(tmp_path / "gateway.toml", '[admin]\nendpoint = "tcp:http"\n' + HUB)
    _only_problem(main, "admin.endpoint", "bad server endpoint 'tcp:http'")


def test_admin_allowed_hosts_are_kept_canonical(tmp_path: Path) -> None:
    """``allowed_hosts`` names and addresses are kept lower-case, unbracketed, once each."""
    main = _write(
        tmp_path / "gateway.toml",
        '[admin]\nallowed_hosts = ["Gateway.Example.org.", "[2001:DB8::1]", "10.0.0.5",'
        ' "gateway.example.org"]\n' + HUB,
    )
    assert load_config(main).admin.allowed_hosts == (
        "gateway.example.org",
        "2001:db8::1",
        "10.0.0.5",
    )


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("gateway.example.org:8790", "not a host name"),
        ("http://gateway", "not a host name"),
        ("", "not a host name"),
        ("[gateway]", "not an IPv6 address"),
    ],
)
def test_bad_admin_allowed_host(tmp_path: Path, entry: str, reason: str) -> None:
    """An ``allowed_hosts`` entry that is not a bare name or address is a problem."""
    main = _write(tmp_path / "gateway.toml", f'[admin]\nallowed_hosts = ["{entry}"]\n' + HUB)
    _only_problem(main, "admin.allowed_hosts", reason, "no port")


# --- names -----------------------------------------------------------------------------------


def test_duplicate_names_across_listeners_and_upstreams(tmp_path: Path) -> None:
    """Listeners and upstreams share one namespace: routes must know which is meant."""
    main = _write(tmp_path / "gateway.toml", HUB + CENTRAL.replace("central", "hub"))
    _only_problem(main, "upstreams.hub", "'hub' is used twice")


@pytest.mark.parametrize("name", ["bad name", "-hub", ".hub", "hüb", "a/b"])
def test_invalid_names(tmp_path: Path, name: str) -> None:
    """Names are letters, digits, ``_ . -`` and start with a letter or digit."""
    main = _write(tmp_path / "gateway.toml", HUB.replace("hub", f'"{name}"'))
    _only_problem(main, f"listeners.{name}", "a name must be letters, digits")


# --- SSMP settings ---------------------------------------------------------------------------


def test_unknown_ssmp_scheme(tmp_path: Path) -> None:
    """A login scheme SSMP does not have is named, with the ones it has."""
    main = _write(tmp_path / "gateway.toml", HUB + 'schemes = ["secret", "kerberos"]\n')
    _only_problem(main, "listeners.hub.schemes", "unknown scheme 'kerberos'", "cert, open, secret")


def test_cert_scheme_needs_tls(tmp_path: Path) -> None:
    """``cert`` on a plain tcp listener is refused: there is no certificate to read."""
    main = _write(tmp_path / "gateway.toml", HUB + 'schemes = ["cert"]\n')
    _only_problem(main, "listeners.hub.schemes", "'cert' needs a TLS endpoint")


@pytest.mark.parametrize(
    ("setting", "key", "reason"),
    [
        ('identity = "bad id"', "identity", "'bad id' is not a valid SSMP identifier"),
        ('subscribe = ["ok", "not ok"]', "subscribe", "'not ok' is not a valid SSMP topic"),
        ('scheme = "kerberos"', "scheme", "must be one of cert, open, secret, not 'kerberos'"),
        ("max_line_bytes = 100", "max_line_bytes", "must be at least 1024"),
    ],
)
def test_bad_upstream_settings(tmp_path: Path, setting: str, key: str, reason: str) -> None:
    """SSMP upstream settings are checked against the spec's identifiers and limits."""
    line = {"identity": 'identity = "gateway-1"', "scheme": 'scheme = "open"'}.get(key)
    text = CENTRAL.replace(line, setting) if line else CENTRAL + setting + "\n"
    main = _write(tmp_path / "gateway.toml", HUB + text)
    # An unknown scheme falls back to the default ("secret"), which may add a
    # second problem about the missing secret; the one checked here must be there.
    _the_problem(_problems(main), main, f"upstreams.central.{key}", reason)


def test_upstream_secret_missing_from_secrets_file(tmp_path: Path) -> None:
    """Scheme ``secret`` without a secret names the secrets file and the key to add."""
    secrets = _write(tmp_path / "secrets.toml", '[upstreams]\nelsewhere = "x"\n')
    main = _write(
        tmp_path / "gateway.toml",
        '[gateway]\nsecrets = "secrets.toml"\n' + HUB + CENTRAL.replace('"open"', '"secret"'),
    )
    _only_problem(main, "upstreams.central", "scheme 'secret'", "no secret", file=secrets)


def test_upstream_secret_without_secrets_file(tmp_path: Path) -> None:
    """Without any secrets file the problem says that ``gateway.secrets`` is missing."""
    main = _write(tmp_path / "gateway.toml", HUB + CENTRAL.replace('scheme = "open"', ""))
    _only_problem(main, "upstreams.central", "no secret", "gateway.secrets names no secrets file")


def test_bad_secrets_file(tmp_path: Path) -> None:
    """Secrets must be strings, and only ``logins`` and ``upstreams`` are known."""
    secrets = _write(tmp_path / "secrets.toml", "[logins]\nalice = 1234\n[login]\nbob = 'x'\n")
    main = _write(tmp_path / "gateway.toml", '[gateway]\nsecrets = "secrets.toml"\n' + HUB)
    problems = _problems(main)
    assert len(problems) == 2, problems
    _the_problem(problems, secrets, "logins.alice", "must be a string, not a number")
    _the_problem(problems, secrets, "login", "unknown key", "did you mean 'logins'?")


# --- routes ----------------------------------------------------------------------------------


def _with_route(tmp_path: Path, route: str, name: str = "r") -> tuple[Path, Path]:
    """Write a valid main file with ``hub`` and ``central`` plus one route file."""
    route_file = _write(tmp_path / "routes" / f"{name}.toml", route)
    main = _write(tmp_path / "gateway.toml", '[gateway]\nroutes = "routes"\n' + HUB + CENTRAL)
    return main, route_file


@pytest.mark.parametrize("key", ["from", "to"])
def test_route_to_unknown_endpoint_lists_the_known(tmp_path: Path, key: str) -> None:
    """A route naming a listener or upstream that does not exist lists those that do."""
    ends = {"from": "hub", "to": "central"} | {key: "nowhere"}
    main, route = _with_route(
        tmp_path, f'from = "{ends["from"]}"\nto = "{ends["to"]}"\nmatch = "a"\n'
    )
    _only_problem(
        main,
        key,
        "no listener or upstream named 'nowhere'",
        "(known: central, hub)",
        file=route,
    )


def test_route_to_itself(tmp_path: Path) -> None:
    """A route must not deliver back to the endpoint it takes from."""
    main, route = _with_route(tmp_path, 'from = "hub"\nto = "hub"\nmatch = "a"\n')
    _only_problem(main, "to", "must not deliver back", file=route)


@pytest.mark.parametrize(
    ("match", "reason"),
    [
        ("weather.*paris", "must stand alone between separators"),
        ("weather..paris", "empty word"),
        ("", "must not be empty"),
    ],
)
def test_bad_match_pattern(tmp_path: Path, match: str, reason: str) -> None:
    """A pattern that cannot work is reported under ``match`` with the reason."""
    main, route = _with_route(tmp_path, f'from = "hub"\nto = "central"\nmatch = "{match}"\n')
    _only_problem(main, "match", reason, file=route)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("{2}", "{2} refers to a wildcard that pattern 'weather.*' does not have (it has 1)"),
        ("{foo}", "unknown field {foo}"),
        ("{²}", "unknown field"),
        ("{1", "unmatched brace"),
        ("", "must not be empty"),
    ],
)
def test_bad_address_template(tmp_path: Path, address: str, reason: str) -> None:
    """A destination template that cannot be expanded is reported under ``address``."""
    main, route = _with_route(
        tmp_path, f'from = "hub"\nto = "central"\nmatch = "weather.*"\naddress = "{address}"\n'
    )
    _only_problem(main, "address", reason, file=route)


def test_durable_route_settings(tmp_path: Path) -> None:
    """``durable = true`` with its retry and dead-letter settings loads."""
    main, _ = _with_route(
        tmp_path,
        'from = "hub"\nto = "central"\nmatch = "a"\ndurable = true\nmax_attempts = 3\n'
        'dead_letter = "dlq"\n',
    )
    [route] = load_config(main).routes
    assert (route.durable, route.max_attempts, route.dead_letter) == (True, 3, "dlq")


def test_durable_route_attempts_must_be_positive(tmp_path: Path) -> None:
    """``max_attempts`` below one is refused."""
    main, route = _with_route(
        tmp_path, 'from = "hub"\nto = "central"\nmatch = "a"\ndurable = true\nmax_attempts = 0\n'
    )
    _only_problem(main, "max_attempts", "at least 1", file=route)


@pytest.mark.parametrize("timeout", ["0", "-1", '"10"'])
def test_bad_route_timeout(tmp_path: Path, timeout: str) -> None:
    """A route's time-out must be a number greater than zero."""
    main, route = _with_route(
        tmp_path, f'from = "hub"\nto = "central"\nmatch = "a"\ntimeout_seconds = {timeout}\n'
    )
    _only_problem(main, "timeout_seconds", "must be", file=route)


def test_route_missing_keys_and_typos(tmp_path: Path) -> None:
    """A route without ``from``/``match`` and with a misspelt key gets all three reported."""
    main, route = _with_route(tmp_path, 'to = "central"\nmatc = "a"\n')
    problems = _problems(main)
    assert len(problems) == 3, problems
    _the_problem(problems, route, "from", "is required")
    _the_problem(problems, route, "match", "is required")
    _the_problem(problems, route, "matc", "did you mean 'match'?")


@pytest.mark.parametrize("name", ["bad name", "-weather", "wëather"])
def test_route_file_with_bad_name(tmp_path: Path, name: str) -> None:
    """A route's name is its file name, so the file name must be a valid name."""
    main, route = _with_route(tmp_path, 'from = "hub"\nto = "central"\nmatch = "a"\n', name)
    _only_problem(main, "-", "route file name must be letters, digits", file=route)


def test_route_with_toml_error(tmp_path: Path) -> None:
    """A route file that is not TOML is reported under its own path."""
    main, route = _with_route(tmp_path, "from = \n")
    _only_problem(main, "-", "not valid TOML", file=route)


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    """Every problem of every file is reported at once, not just the first."""
    _write(tmp_path / "routes" / "bad.toml", 'from = "hub"\nto = "hub"\nmatch = "a..b"\n')
    _write(tmp_path / "routes" / "worse.toml", 'from = "ghost"\nto = "central"\nmatch = "a"\n')
    main = _write(
        tmp_path / "gateway.toml",
        """
        [gateway]
        routes = "routes"
        colour = "blue"

        [listeners.hub]
        protocol = "ssmp"
        endpoint = "tcp:notaport"
        login_timeout_seconds = -1
        schemes = ["cert"]

        [upstreams.central]
        protocol = "ssmp"
        endpoint = "tcp:host=127.0.0.1:port=9787"
        identity = "gateway-1"
        scheme = "open"
        ping_interval_seconds = false
        """,
    )
    problems = _problems(main)
    where = {(Path(p.file).name, p.key) for p in problems}
    assert where == {
        ("gateway.toml", "gateway.colour"),
        ("gateway.toml", "listeners.hub.endpoint"),
        ("gateway.toml", "listeners.hub.login_timeout_seconds"),
        ("gateway.toml", "listeners.hub.schemes"),
        ("gateway.toml", "upstreams.central.ping_interval_seconds"),
        ("bad.toml", "match"),
        ("bad.toml", "to"),
        ("worse.toml", "from"),
    }
    assert len(problems) == len(where)


STREAMS = """
    [listeners.streams]
    protocol = "stream"
    endpoint = "tcp:0:interface=127.0.0.1"
"""


@pytest.mark.parametrize(
    ("route", "key"),
    [
        ('match = "a"\naddress = "msggateway.outcomes"\n', "address"),
        ('match = "a"\nrecipients = ["ok", "msggateway.route.r"]\n', "recipients"),
        ('match = "msggateway.dead-letter"\n', "match"),
    ],
    ids=["address", "recipients", "kept-address"],
)
def test_a_route_into_the_gateways_own_streams(tmp_path: Path, route: str, key: str) -> None:
    """A route that names a ``msggateway.*`` stream as its fixed destination is refused."""
    route_file = _write(tmp_path / "routes" / "r.toml", 'from = "hub"\nto = "streams"\n' + route)
    main = _write(tmp_path / "gateway.toml", '[gateway]\nroutes = "routes"\n' + HUB + STREAMS)
    _only_problem(main, key, "the gateway's own streams", file=route_file)


def test_a_template_may_reach_the_gateways_own_streams_at_run_time(tmp_path: Path) -> None:
    """``address = "{1}"`` is valid: what it expands to is refused per message, at run time."""
    _write(
        tmp_path / "routes" / "r.toml",
        'from = "hub"\nto = "streams"\nmatch = "in.*"\naddress = "{1}"\n',
    )
    main = _write(tmp_path / "gateway.toml", '[gateway]\nroutes = "routes"\n' + HUB + STREAMS)
    assert [route.name for route in load_config(main).routes] == ["r"]


def test_a_route_file_with_several_problems_reports_each(tmp_path: Path) -> None:
    """A route's own problems do not hide those of its ends: each is reported, by key."""
    main, route = _with_route(
        tmp_path,
        'from = "ghost"\nto = "nowhere"\nmatch = "a..b"\ntimeout_seconds = -1\ncolour = "red"\n',
    )
    problems = _problems(main)
    assert len(problems) == 5, problems
    _the_problem(problems, route, "from", "no listener or upstream named 'ghost'")
    _the_problem(problems, route, "to", "no listener or upstream named 'nowhere'")
    _the_problem(problems, route, "match", "empty word")
    _the_problem(problems, route, "timeout_seconds", "greater than 0")
    _the_problem(problems, route, "colour", "unknown key")


def test_a_route_looping_back_with_a_bad_pattern_reports_both(tmp_path: Path) -> None:
    """A route to where it takes from, with a bad pattern too, gets both reported."""
    main, route = _with_route(tmp_path, 'from = "hub"\nto = "hub"\nmatch = "a.*b"\n')
    problems = _problems(main)
    assert len(problems) == 2, problems
    _the_problem(problems, route, "to", "must not deliver back")
    _the_problem(problems, route, "match", "must stand alone")


def test_a_route_file_with_a_bad_name_reports_its_other_problems(tmp_path: Path) -> None:
    """A route file whose name is refused is still read: its own problems come too."""
    main, route = _with_route(tmp_path, 'from = "hub"\nto = "ghost"\nmatch = "a"\n', "bad name")
    problems = _problems(main)
    assert len(problems) == 2, problems
    _the_problem(problems, route, "-", "route file name must be letters")
    _the_problem(problems, route, "to", "no listener or upstream named 'ghost'")


def test_an_inline_route_with_several_problems_reports_each(tmp_path: Path) -> None:
    """A ``[routes.NAME]`` table of the main file reports its own and its ends' problems."""
    main = _write(
        tmp_path / "gateway.toml",
        HUB + '\n[routes.r]\nfrom = "ghost"\nto = "hub"\nmatch = "a..b"\n',
    )
    problems = _problems(main)
    assert len(problems) == 2, problems
    _the_problem(problems, main, "routes.r.from", "no listener or upstream named 'ghost'")
    _the_problem(problems, main, "routes.r.match", "empty word")


def test_reload_reports_every_problem_of_a_route_file(tmp_path: Path) -> None:
    """A reload refused for a route file names each of its problems, its ends' included."""
    config = load_config(_full_tree(tmp_path))
    broken = _write(
        tmp_path / "routes" / "broken.toml", 'from = "hub"\nto = "ghost"\nmatch = "a..b"\n'
    )
    with pytest.raises(ConfigError) as caught:
        reload_routes(config)
    problems = caught.value.problems
    assert len(problems) == 2, problems
    _the_problem(problems, broken, "to", "no listener or upstream named 'ghost'")
    _the_problem(problems, broken, "match", "empty word")


def test_problem_text_is_file_key_reason() -> None:
    """A problem prints as ``file: key: reason``; the error joins them by lines."""
    first = ConfigProblem("a.toml", "listeners.hub.endpoint", "is required (a string)")
    second = ConfigProblem("b.toml", "-", "file not found")
    assert str(first) == "a.toml: listeners.hub.endpoint: is required (a string)"
    assert str(ConfigError([first, second])) == f"{first}\n{second}"


def test_a_problem_of_the_whole_file_prints_without_a_key() -> None:
    """A problem of the file as a whole (key ``-``) prints as ``file: reason``, no ``-:``."""
    assert str(ConfigProblem("b.toml", "-", "file not found")) == "b.toml: file not found"


# --- reload -----------------------------------------------------------------------------------


def test_reload_routes_returns_the_new_routes(tmp_path: Path) -> None:
    """`reload_routes` reads the route files again, added and removed ones included."""
    config = load_config(_full_tree(tmp_path))
    (tmp_path / "routes" / "alerts-from-central.toml").unlink()
    _write(tmp_path / "routes" / "news.toml", 'from = "side"\nto = "central"\nmatch = "news.*"\n')
    routes = reload_routes(config)
    assert [route.name for route in routes] == ["news", "weather-to-central"]
    assert routes[0] == Route(
        name="news", source="side", pattern=AddressPattern("news.*"), destination="central"
    )


def test_reload_routes_refuses_an_invalid_set(tmp_path: Path) -> None:
    """Invalid route files raise `ConfigError` with every problem; nothing is returned."""
    config = load_config(_full_tree(tmp_path))
    broken = _write(
        tmp_path / "routes" / "broken.toml", 'from = "hub"\nto = "ghost"\nmatch = "a"\n'
    )
    bad = _write(tmp_path / "routes" / "bad.toml", 'from = "hub"\nto = "central"\n')
    with pytest.raises(ConfigError) as caught:
        reload_routes(config)
    problems = caught.value.problems
    assert len(problems) == 2, problems
    _the_problem(problems, broken, "to", "no listener or upstream named 'ghost'")
    _the_problem(problems, bad, "match", "is required")


def test_reload_routes_without_routes_directory(tmp_path: Path) -> None:
    """A config without a routes directory reloads to no routes; a vanished one is an error."""
    assert reload_routes(load_config(_write(tmp_path / "plain.toml", HUB))) == ()
    config = load_config(_full_tree(tmp_path / "full"))
    for path in (tmp_path / "full" / "routes").iterdir():
        path.unlink()
    (tmp_path / "full" / "routes").rmdir()
    with pytest.raises(ConfigError, match="routes directory not found"):
        reload_routes(config)


def test_stream_listener_and_log_settings(tmp_path: Path) -> None:
    """A stream listener's settings and the [log] section load into their objects."""
    main = _write(
        tmp_path / "gateway.toml",
        """
        [log]
        fsync = "interval"
        fsync_interval_seconds = 0.5
        inline_commit_max_bytes = 0
        segment_bytes = 1048576
        max_bytes = 100000000
        max_age_seconds = 86400

        [listeners.streams]
        protocol = "stream"
        endpoint = "tcp:0:interface=127.0.0.1"
        advertised_host = "gateway.example.org"
        advertised_port = 5552
        anonymous = true
        frame_max = 131072
        heartbeat_seconds = 20
        """,
    )
    config = load_config(main)
    [listener] = config.listeners
    settings = listener.settings
    assert (settings.advertised_host, settings.advertised_port) == ("gateway.example.org", 5552)
    assert settings.anonymous and not settings.guest
    assert (settings.frame_max, settings.heartbeat_seconds) == (131072, 20)
    assert config.log.fsync == "interval"
    assert config.log.fsync_interval_seconds == 0.5
    assert config.log.inline_commit_max_bytes == 0
    assert (config.log.max_bytes, config.log.max_age_seconds) == (100000000, 86400)


def test_bad_fsync_policy(tmp_path: Path) -> None:
    """An unknown fsync policy is reported under log.fsync with the choices."""
    main = _write(tmp_path / "gateway.toml", '[log]\nfsync = "sometimes"\n')
    _only_problem(main, "log.fsync", "always, interval, never")


RABBIT = """
    [upstreams.rabbit]
    protocol = "stream"
    endpoint = "tcp:host=127.0.0.1:port=5552"
    subscribe = ["in"]
"""
"""A stream upstream consuming ``in``, with guest's default password."""


@pytest.mark.parametrize("where", ["leader", "replica"])
def test_stream_upstream_consume_from(tmp_path: Path, where: str) -> None:
    """``consume_from`` takes leader or replica; leader when absent."""
    main = _write(tmp_path / "gateway.toml", RABBIT + f'consume_from = "{where}"\n')
    [upstream] = load_config(main).upstreams
    assert upstream.settings.consume_from == where
    default = _write(tmp_path / "default.toml", RABBIT)
    assert load_config(default).upstreams[0].settings.consume_from == "leader"


def test_stream_upstream_bad_consume_from(tmp_path: Path) -> None:
    """Any other ``consume_from`` is reported with file, key and the choices."""
    main = _write(tmp_path / "gateway.toml", RABBIT + 'consume_from = "follower"\n')
    _only_problem(main, "upstreams.rabbit.consume_from", "'follower'", "leader", "replica")


def test_dmp_listener_leases(tmp_path: Path) -> None:
    """Leases name one sink or feed that exists, an optional expiry, and a text in the secrets."""
    _write(tmp_path / "secrets.toml", '[leases]\nwriter = "W-1"\n')
    main = _write(
        tmp_path / "gateway.toml",
        """
        [gateway]
        secrets = "secrets.toml"

        [listeners.dmp]
        protocol = "dmp"
        endpoint = "tcp:0:interface=127.0.0.1"
        sinks = ["orders"]
        feeds = ["alerts"]

        [listeners.dmp.leases]
        writer = { sink = "orders", expires = "2030-01-01T00:00:00Z" }
        """,
    )
    [listener] = load_config(main).listeners
    grant = listener.settings.leases["writer"]
    assert (grant.kind, grant.target, grant.expires) == ("sink", "orders", 1893456000.0)
    bad = main.read_text().replace('writer = { sink = "orders"', 'writer = { feed = "nope"')
    main.write_text(bad)
    _only_problem(main, "listeners.dmp.leases.writer.feed", "no feed named 'nope'")


def test_dmp_listener_principals(tmp_path: Path) -> None:
    """``principals`` lists login identities; ``principal_lease_seconds`` must be positive."""
    text = """
        [listeners.dmp]
        protocol = "dmp"
        endpoint = "tcp:0:interface=127.0.0.1"
        sinks = ["orders"]
        principals = ["app"]
        principal_lease_seconds = 5
        """
    main = _write(tmp_path / "gateway.toml", text)
    [listener] = load_config(main).listeners
    assert listener.settings.principals == frozenset({"app"})
    assert listener.settings.principal_lease_seconds == 5.0
    main.write_text(
        main.read_text().replace("principal_lease_seconds = 5", "principal_lease_seconds = 0")
    )
    _only_problem(main, "listeners.dmp.principal_lease_seconds", "greater than 0")
    main.write_text(main.read_text().replace('principals = ["app"]', "principals = [1]"))
    main.write_text(
        main.read_text().replace("principal_lease_seconds = 0", "principal_lease_seconds = 9")
    )
    _only_problem(main, "listeners.dmp.principals", "only strings")


def test_dmp_upstream_principal_needs_a_target(tmp_path: Path) -> None:
    """An upstream with ``principal`` names the remote sink or feed in ``target``."""
    _write(tmp_path / "secrets.toml", '[upstreams]\norders = "pw"\n')
    text = """
        [gateway]
        secrets = "secrets.toml"

        [upstreams.orders]
        protocol = "dmp"
        endpoint = "tcp:host=127.0.0.1:port=5554"
        principal = "app"
        target = "orders"
        """
    main = _write(tmp_path / "gateway.toml", text)
    [upstream] = load_config(main).upstreams
    assert (upstream.settings.principal, upstream.settings.target) == ("app", "orders")
    main.write_text(main.read_text().replace('target = "orders"', ""))
    _only_problem(main, "upstreams.orders.target", "principal")


def test_listener_max_connections(tmp_path: Path) -> None:
    """Every listener takes max_connections (1024 unless set); it must be at least 1."""
    main = _write(tmp_path / "gateway.toml", HUB)
    assert load_config(main).listeners[0].max_connections == 1024
    main = _write(tmp_path / "gateway.toml", HUB + "max_connections = 10\n")
    assert load_config(main).listeners[0].max_connections == 10
    main = _write(tmp_path / "gateway.toml", HUB + "max_connections = 0\n")
    _only_problem(main, "listeners.hub.max_connections", "at least 1")


def test_listener_backlog_defaults_to_1024_and_reaches_the_listen_call(tmp_path: Path) -> None:
    """Every listener listens with a queue of 1024 unless ``backlog`` says otherwise."""
    from gateway.service import build_gateway

    main = _write(tmp_path / "gateway.toml", HUB)
    [listener] = load_config(main).listeners
    assert listener.backlog == 1024
    assert listener.listen_endpoint == "tcp:0:interface=127.0.0.1:backlog=1024"
    reactor = MemoryReactor()
    config = load_config(_write(tmp_path / "g.toml", HUB + "backlog = 4096\n"))
    gateway = build_gateway(config, reactor)
    gateway.startService()
    try:
        hub = [(port, backlog, host) for port, _, backlog, host in reactor.tcpServers if port == 0]
        assert hub == [(0, 4096, "127.0.0.1")]
    finally:
        gateway.stopService()


def test_listener_backlog_in_the_endpoint_string_or_the_key(tmp_path: Path) -> None:
    """An endpoint's own backlog= is kept; setting it there and in ``backlog`` is refused."""
    own = HUB.replace("interface=127.0.0.1", "interface=127.0.0.1:backlog=77")
    [listener] = load_config(_write(tmp_path / "own.toml", own)).listeners
    assert listener.listen_endpoint.endswith(":backlog=77")
    _only_problem(_write(tmp_path / "both.toml", own + "backlog = 5\n"), "listeners.hub.backlog")
    _only_problem(_write(tmp_path / "zero.toml", HUB + "backlog = 0\n"), "listeners.hub.backlog")


def test_listener_frame_timeout(tmp_path: Path) -> None:
    """Every listener takes ``frame_timeout_seconds`` (30 unless set, 0 for off, not negative)."""
    assert {listener.frame_timeout_seconds for listener in load_default_config().listeners} == {
        30.0
    }
    main = _write(tmp_path / "gateway.toml", HUB + "frame_timeout_seconds = 2.5\n")
    assert load_config(main).listeners[0].frame_timeout_seconds == 2.5
    main = _write(tmp_path / "off.toml", HUB + "frame_timeout_seconds = 0\n")
    assert load_config(main).listeners[0].frame_timeout_seconds == 0
    main = _write(tmp_path / "bad.toml", HUB + "frame_timeout_seconds = -1\n")
    _only_problem(main, "listeners.hub.frame_timeout_seconds", "at least 0")


def test_every_listener_factory_gets_its_frame_timeout(tmp_path: Path) -> None:
    """The assembly hands each TCP listener's ``frame_timeout_seconds`` to its factory."""
    from gateway.protocols.listener import ListenerFactory
    from gateway.service import build_gateway

    listeners = "".join(
        f"""
        [listeners.{protocol}]
        protocol = "{protocol}"
        endpoint = "tcp:0:interface=127.0.0.1"
        frame_timeout_seconds = {seconds}
        {extra}
        """
        for protocol, seconds, extra in (
            ("ssmp", 7, 'schemes = ["open"]'),
            ("qmqp", 8, ""),
            ("stream", 9, ""),
            ("dmp", 10, 'sinks = ["s"]'),
        )
    )
    main = _write(tmp_path / "gateway.toml", f'[gateway]\ndata_dir = "data"\n{listeners}')
    gateway = build_gateway(load_config(main), MemoryReactorClock())
    factories = {endpoint.name: endpoint.service.factory for endpoint in gateway.endpoints.values()}
    assert all(isinstance(factory, ListenerFactory) for factory in factories.values())
    assert {name: factory.frame_timeout_seconds for name, factory in factories.items()} == {
        "ssmp": 7,
        "qmqp": 8,
        "stream": 9,
        "dmp": 10,
    }


def test_max_connections_per_identity(tmp_path: Path) -> None:
    """The per-identity limit is read; negative numbers are refused."""
    config = load_config(
        _write(
            tmp_path / "gateway.toml",
            HUB.replace('protocol = "ssmp"', 'protocol = "ssmp"\nmax_connections_per_identity = 3'),
        )
    )
    assert config.listeners[0].max_connections_per_identity == 3
    bad = _write(
        tmp_path / "bad.toml",
        HUB.replace('protocol = "ssmp"', 'protocol = "ssmp"\nmax_connections_per_identity = -1'),
    )
    _only_problem(bad, "listeners.hub.max_connections_per_identity")
