"""``msggateway qmqp send`` against a real gateway process.

The gateway's QMQP listener routes ``*@ok.example`` to its SSMP hub (K),
``*@down.example`` to an SSMP upstream that is not connected (Z), and has no
route for anything else (D). The installed console script runs as a
subprocess on a directory of files and on an mbox, and against a listener
that requires authentication.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
enabled = false

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.locked]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.nowhere]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "gw"
scheme = "open"
"""

SECRETS = """
[logins]
mailer = "right-password"
"""

ROUTES = {
    "ok": 'from = "qmqp"\nmatch = "*@ok.example"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
    "locked": 'from = "locked"\nmatch = "*@ok.example"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
    "down": 'from = "qmqp"\nmatch = "*@down.example"\nto = "nowhere"\nbody = "subject"\n',
}

MSGGATEWAY = str(Path(sys.executable).with_name("msggateway"))
COUNTS = re.compile(r"K (\d+), Z (\d+), D (\d+), errors (\d+)")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway with an open and a locked QMQP listener, a hub and the routes above."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("cli-qmqp"), CONFIG, routes=ROUTES, secrets=SECRETS
    ).start()
    yield process
    process.stop()


def address(gateway: GatewayProcess, listener: str) -> str:
    """``HOST:PORT`` of a listener."""
    host, port = gateway.address(listener)
    return f"{host}:{port}"


def send(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``msggateway qmqp send ARGS`` to completion."""
    return subprocess.run(
        [MSGGATEWAY, "qmqp", "send", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


def counts(out: str) -> tuple[int, ...]:
    """K, Z, D and error counts from a summary's first line."""
    found = COUNTS.fullmatch(out.splitlines()[0])
    assert found, out
    return tuple(int(group) for group in found.groups())


def listed(out: str, kind: str) -> list[str]:
    """The ids of a summary's lines of one kind (``Z``, ``D`` or ``error``)."""
    return [line.split(" ", 2)[1].rstrip(":") for line in out.splitlines()[1:]
            if line.startswith(f"{kind} ")]  # fmt: skip


def rfc822(recipient: str, subject: str) -> str:
    """A small message to one recipient."""
    return f"From: app@example.org\nTo: {recipient}\nSubject: {subject}\n\nbody of {subject}\n"


def test_directory_of_three_files(gateway: GatewayProcess, tmp_path: Path) -> None:
    """K, Z and D: one of each, the Z and D listed by file name with the gateway's reason."""
    mails = tmp_path / "mails"
    mails.mkdir()
    (mails / "1-ok.eml").write_text(rfc822("ops@ok.example", "fine"))
    (mails / "2-down.eml").write_text(rfc822("ops@down.example", "later"))
    (mails / "3-nowhere.eml").write_text(rfc822("ops@elsewhere.example", "never"))
    done = send(address(gateway, "qmqp"), str(mails))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr == ""  # no terminal, no --progress: no progress
    assert counts(done.stdout) == (1, 1, 1, 0)
    lines = done.stdout.splitlines()
    assert lines[1].startswith("Z 2-down.eml: ") and "nowhere is not connected" in lines[1]
    assert lines[2] == "D 3-nowhere.eml: no route for recipient ops@elsewhere.example"
    assert len(lines) == 3


def test_all_k_exits_zero(gateway: GatewayProcess, tmp_path: Path) -> None:
    """Every message accepted: exit status 0 and only the counts."""
    for number in range(3):
        (tmp_path / f"{number}.eml").write_text(rfc822(f"u{number}@ok.example", f"m{number}"))
    done = send(address(gateway, "qmqp"), str(tmp_path), "--window", "2")
    assert (done.returncode, done.stdout, done.stderr) == (0, "K 3, Z 0, D 0, errors 0\n", "")


def test_mbox_of_two_hundred_messages_with_progress(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    """An mbox of 200: counts, the Z and D listed as mbox:N, a bar on stderr (--force-progress)."""
    parts = []
    down, nowhere = [], []
    for index in range(200):
        number = index + 1
        if index % 10 == 3:
            recipient = f"u{number}@down.example"
            down.append(f"mbox:{number}")
        elif index % 10 == 7:
            recipient = f"u{number}@elsewhere.example"
            nowhere.append(f"mbox:{number}")
        else:
            recipient = f"u{number}@ok.example"
        parts.append(
            f"From app@example.org Mon Jan  1 00:00:00 2024\n{rfc822(recipient, str(number))}\n"
        )
    box = tmp_path / "mail.mbox"
    box.write_text("".join(parts))
    done = send(address(gateway, "qmqp"), str(box), "--window", "16", "--force-progress")
    assert done.returncode == 1, done.stdout + done.stderr
    assert counts(done.stdout) == (160, 20, 20, 0)
    assert listed(done.stdout, "Z") == down
    assert listed(done.stdout, "D") == nowhere
    assert "D mbox:8: no route for recipient u8@elsewhere.example" in done.stdout
    # Text mode reads tqdm's carriage returns as line ends; the last draw is the whole.
    last = done.stderr.splitlines()[-1]
    assert last.startswith("answered: 100%") and "200/200" in last and "sent=200" in last


def test_recipients_and_ids_from_options(gateway: GatewayProcess, tmp_path: Path) -> None:
    """--recipient replaces the headers' recipients; --id-prefix shows in the listed ids."""
    (tmp_path / "m.eml").write_text(rfc822("ops@ok.example", "redirected"))
    done = send(address(gateway, "qmqp"), str(tmp_path), "--recipient", "x@down.example",
                "--id-prefix", "run1/")  # fmt: skip
    assert done.returncode == 1
    assert counts(done.stdout) == (0, 1, 0, 0)
    assert listed(done.stdout, "Z") == ["run1/m.eml"]


def test_authentication(gateway: GatewayProcess, tmp_path: Path) -> None:
    """The right password passes the locked listener; a wrong one gets a clear refusal."""
    (tmp_path / "m.eml").write_text(rfc822("ops@ok.example", "locked"))
    args = (address(gateway, "locked"), str(tmp_path), "--username", "mailer",
            "--password-env", "QMQP_PASSWORD")  # fmt: skip
    accepted = send(*args, env={"QMQP_PASSWORD": "right-password"})
    assert (accepted.returncode, accepted.stdout) == (0, "K 1, Z 0, D 0, errors 0\n")
    refused = send(*args, env={"QMQP_PASSWORD": "wrong-password"})
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == "msggateway: authentication refused for mailer\n"


def test_without_authentication_the_locked_listener_refuses_each_message(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    """No A block where one is required: every message gets the gateway's D."""
    (tmp_path / "m.eml").write_text(rfc822("ops@ok.example", "anonymous"))
    done = send(address(gateway, "locked"), str(tmp_path))
    assert done.returncode == 1
    assert done.stdout == (
        "K 0, Z 0, D 1, errors 0\nD m.eml: authentication required: send an A block first\n"
    )
