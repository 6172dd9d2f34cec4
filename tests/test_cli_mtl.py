"""``msggateway mtl``: keygen's CURVE key file, and the writer's outcomes.

The writer is driven by `FakeSession`, which records the data commands sent
and answers from a queue: no sockets. send and receive against a real
gateway are in tests/integration/test_cli_mtl.py.
"""

from __future__ import annotations

import io
import json
import stat
from collections import deque
from pathlib import Path

import zmq

from gateway.cli import main
from gateway.cli.mtl import MTLSession, _Writer
from gateway.cli.output import Output
from gateway.codecs import mtl
from gateway.config import load_config
from gateway.protocols.mtl.settings import MTLListenerSettings


def test_keygen_writes_a_key_the_listener_loads(tmp_path: Path) -> None:
    """The file is private, loads as curve_secret_key_file, and matches the printed key."""
    out, err = io.StringIO(), io.StringIO()
    assert main(["mtl", "keygen", str(tmp_path / "mtl.key")], out=out, err=err) == 0
    assert stat.S_IMODE((tmp_path / "mtl.key").stat().st_mode) == 0o600
    main_file = tmp_path / "gateway.toml"
    main_file.write_text(
        '[listeners.mtl]\nprotocol = "mtl"\nendpoint = "tcp:0"\ncurve_secret_key_file = "mtl.key"\n'
    )
    (listener,) = load_config(main_file).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    secret_key = listener.settings.curve_secret_key
    assert secret_key is not None
    assert out.getvalue() == zmq.curve_public(secret_key).decode() + "\n"
    assert err.getvalue() == ""


def test_keygen_never_overwrites(tmp_path: Path) -> None:
    """An existing file is left alone and the command fails, saying why."""
    (tmp_path / "mtl.key").write_text("keep me")
    out, err = io.StringIO(), io.StringIO()
    assert main(["mtl", "keygen", str(tmp_path / "mtl.key")], out=out, err=err) == 1
    assert (tmp_path / "mtl.key").read_text() == "keep me"
    assert "File exists" in err.getvalue() and out.getvalue() == ""


class FakeSession(MTLSession):
    """A session without sockets: `send` records, `next` answers from a queue."""

    def __init__(self, answers: list[mtl.DataCommand]) -> None:
        self.sent: list[mtl.DataCommand] = []
        self.answers = deque(answers)
        self.steps: list[str] = []

    def send(self, command: mtl.DataCommand) -> None:
        """Record the command."""
        self.sent.append(command)
        self.steps.append(type(command).__name__)

    def next(self, waiting_for: str) -> mtl.DataCommand:
        """The next queued answer."""
        assert self.answers, f"nothing queued for {waiting_for}"
        self.steps.append("read")
        return self.answers.popleft()


def outcomes(out: io.StringIO) -> list[tuple[int, str]]:
    """Message numbers and outcomes of the JSON lines printed."""
    return [(r["message"], r["outcome"]) for r in map(json.loads, out.getvalue().splitlines())]


def test_confirmed_outcomes_in_order_with_multiple_and_recycle() -> None:
    """Reject recycle is retry, Reject rejected, a multiple Confirm covers the rest; in order."""
    session = FakeSession([
        mtl.Reject(2, recycle=True), mtl.Reject(1), mtl.Confirm(4, multiple=True),
    ])  # fmt: skip
    out = io.StringIO()
    writer = _Writer(session, Output(out, json_lines=True), lambda n: None, resource="r")
    assert writer.confirmed([b"a", b"b", b"c", b"d"], {}, window=10) == 1
    assert outcomes(out) == [(1, "rejected"), (2, "retry"), (3, "accepted"), (4, "accepted")]
    assert [c.sequence for c in session.sent if isinstance(c, mtl.Content)] == [1, 2, 3, 4]


def test_the_window_holds_back_contents_until_confirms_come() -> None:
    """Window 2: the third Content goes only after the first is confirmed."""
    session = FakeSession([mtl.Confirm(1), mtl.Confirm(3, multiple=True)])
    out = io.StringIO()
    writer = _Writer(session, Output(out, json_lines=True), lambda n: None, resource="r")
    assert writer.confirmed([b"a", b"b", b"c"], {"k": "v"}, window=2) == 0
    assert session.steps == ["Content", "Content", "read", "Content", "read"]
    assert session.sent[0] == mtl.Content(1, "r", {"k": "v"}, b"a")
    assert outcomes(out) == [(1, "accepted"), (2, "accepted"), (3, "accepted")]


def test_unconfirmed_contents_are_sent_once_the_pong_comes() -> None:
    """confirm=none: every Content, then a Ping; each is 'sent' after the Pong."""
    session = FakeSession([mtl.Pong()])
    out = io.StringIO()
    writer = _Writer(session, Output(out, json_lines=False), lambda n: None, resource="r")
    assert writer.unconfirmed([b"a", b"b"], {}) == 0
    assert [type(c).__name__ for c in session.sent] == ["Content", "Content", "Ping"]
    assert out.getvalue() == "1 sent\n2 sent\n"
