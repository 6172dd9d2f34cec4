"""Two listeners on one port are refused by the configuration check (`gateway.config.ports`)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, load_config

ADMIN_OFF = "[admin]\nenabled = false\n"


def _listener(name: str, endpoint: str, protocol: str = "qmqp") -> str:
    """A listener table; the endpoint as a TOML literal string (backslashes kept)."""
    return f"[listeners.{name}]\nprotocol = \"{protocol}\"\nendpoint = '{endpoint}'\n"


def _problems(tmp_path: Path, text: str) -> list[str]:
    """The problems of a main file, as check-config prints them."""
    path = tmp_path / "gateway.toml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as exc:
        return [str(problem) for problem in exc.problems]
    return []


def test_two_listeners_on_one_port_are_one_problem_naming_both(tmp_path: Path) -> None:
    """check-config names the file, the second listener's key, the address and the first's key."""
    path = tmp_path / "gateway.toml"
    path.write_text(
        ADMIN_OFF
        + _listener("hub", "tcp:8787:interface=127.0.0.1")
        + _listener("mail", "tcp:8787:interface=127.0.0.1"),
        encoding="utf-8",
    )
    out, err = io.StringIO(), io.StringIO()
    assert main(["check-config", str(path)], out, err) == 1
    assert err.getvalue() == (
        f"{path}: listeners.mail.endpoint: 127.0.0.1:8787 is also where"
        " listeners.hub.endpoint listens; only one can listen there\n1 problem(s) found\n"
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("tcp:8787", "tcp:8787:interface=127.0.0.1"),
        ("tcp:8787:interface=0.0.0.0", "tcp:port=8787:interface=127.0.0.1"),
        ("tcp6:8787", "tcp:8787:interface=127.0.0.1"),
        ("tcp6:8787:interface=\\:\\:1", "tcp6:8787:interface=\\:\\:1"),
    ],
    ids=["any-v4", "zeros-v4", "dual-stack", "v6"],
)
def test_a_wildcard_clashes_with_an_address_of_its_family(
    tmp_path: Path, first: str, second: str
) -> None:
    """No interface (or 0.0.0.0) takes every IPv4 address of the port; ``::`` takes all."""
    problems = _problems(tmp_path, ADMIN_OFF + _listener("a", first) + _listener("b", second))
    assert len(problems) == 1 and "listeners.b.endpoint: " in problems[0], problems
    assert "listeners.a.endpoint listens" in problems[0]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("tcp:8787:interface=127.0.0.1", "tcp:8787:interface=127.0.0.2"),
        ("tcp:8787:interface=127.0.0.1", "tcp:8788:interface=127.0.0.1"),
        ("tcp:0:interface=127.0.0.1", "tcp:0:interface=127.0.0.1"),
        ("tcp:8787:interface=0.0.0.0", "tcp6:8787:interface=\\:\\:1"),
    ],
    ids=["other-address", "other-port", "port-0", "v4-any-v6-one"],
)
def test_listeners_that_can_both_listen_pass(tmp_path: Path, first: str, second: str) -> None:
    """Other addresses, other ports, and port 0 (the system picks) are no clash."""
    assert _problems(tmp_path, ADMIN_OFF + _listener("a", first) + _listener("b", second)) == []


def test_the_admin_endpoint_and_an_mtl_data_port_claim_their_ports(tmp_path: Path) -> None:
    """The admin endpoint clashes with an MTL listener's data port, and that with its control."""
    mtl = _listener("bus", "tcp:5555:interface=127.0.0.1", "mtl") + "data_port = 8790\n"
    hub = _listener("hub", "tcp:5555:interface=127.0.0.1", "ssmp") + 'schemes = ["open"]\n'
    admin = '[admin]\nendpoint = "tcp:8790:interface=127.0.0.1"\n'
    problems = _problems(tmp_path, admin + mtl + hub)
    assert sorted(problem.split(": ")[1] for problem in problems) == [
        "admin.endpoint",
        "listeners.hub.endpoint",
    ]
    assert any("where listeners.bus.data_port listens" in problem for problem in problems)
    assert any("where listeners.bus.endpoint listens" in problem for problem in problems)


def test_the_shipped_configurations_have_no_clash() -> None:
    """The embedded default and etc/gateway.toml pass (their ports are all different)."""
    out, err = io.StringIO(), io.StringIO()
    assert main(["check-config"], out, err) == 0, err.getvalue()
    etc = Path(__file__).parents[1] / "etc" / "gateway.toml"
    assert main(["check-config", str(etc)], out, err) == 0, err.getvalue()
