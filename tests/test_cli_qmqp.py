"""Tests of `gateway.cli.qmqp.session` and ``msggateway qmqp send``.

The session (the one blocking QMQP client, on the gateway's codec) and the
command are checked against
`FakeQMQPServer`, a small real QMQP streaming server made of our own codec in
a background thread on 127.0.0.1 port 0: it answers by recipient domain,
holds replies to answer them out of order, and checks the window.
"""

from __future__ import annotations

import io
import json
import socket
import ssl
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.cli.connection import connect, tls_context
from gateway.cli.qmqp.mail import Envelope, Item, LocalFailure, Outgoing
from gateway.cli.qmqp.session import QMQPAuthRefusedError, QMQPSender, Summary
from gateway.codecs import qmqp
from tests.certs import make_pki
from tests.test_cli_mail import write_mails

SERVER_TIMEOUT_SECONDS = 10.0


class FakeQMQPServer:
    """A small real QMQP streaming server for one connection.

    Each message gets one reply, by its recipients: D if one is outside
    ``ok.example`` and ``down.example``, else Z if one is at
    ``down.example``, else K. Replies are held until ``hold`` messages are
    unanswered (or the done block comes) and then sent newest first, so that
    they arrive out of order.

    Args:
        hold: Replies are sent once this many messages are unanswered.
        window: More unanswered messages than this is a violation.
        answer: False: never reply (nor send the done block).
        close_after: Half-close after answering this many messages.
        users: Username to password, for A blocks.
        success_digit: What the A reply says for success: ``1`` (the
            spec's prose) or ``0`` (its example).
        context: Serve TLS with this server context.
        garbage: Send these bytes instead of the first reply, then only read.
    """

    def __init__(
        self,
        *,
        hold: int = 1,
        window: int | None = None,
        answer: bool = True,
        close_after: int | None = None,
        users: dict[bytes, bytes] | None = None,
        success_digit: bytes = b"1",
        context: ssl.SSLContext | None = None,
        garbage: bytes | None = None,
    ) -> None:
        self._garbage = garbage
        self._hold = hold
        self._window = window
        self._answer = answer
        self._close_after = close_after
        self._users = users or {}
        self._success_digit = success_digit
        self._context = context
        self.received: list[qmqp.MessageBlock] = []
        self.replied: list[bytes] = []
        self.auth: list[tuple[bytes, bool]] = []
        self.max_unanswered = 0
        self.violations: list[str] = []
        self.failure: BaseException | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(SERVER_TIMEOUT_SECONDS)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the connection to end; re-raise what went wrong in the server."""
        self._thread.join(SERVER_TIMEOUT_SECONDS)
        self._listener.close()
        assert not self._thread.is_alive(), "the fake server did not finish"
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        try:
            conn, _ = self._listener.accept()
            conn.settimeout(SERVER_TIMEOUT_SECONDS)
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            with conn:
                self._serve(conn)
        except BaseException as exc:  # reported by join()
            self.failure = exc

    def _serve(self, conn: socket.socket) -> None:
        codec = qmqp.QMQPCodec(qmqp.Role.SERVER)
        held: list[qmqp.ReplyBlock] = []
        while True:
            data = conn.recv(65536)
            if not data:
                return
            for block in codec.receive_data(data):
                if isinstance(block, qmqp.AuthBlock):
                    accepted = self._users.get(block.username) == block.password
                    self.auth.append((block.username, accepted))
                    says_one = accepted == (self._success_digit == b"1")
                    conn.sendall(qmqp.encode(qmqp.AuthReplyBlock(success=says_one)))
                elif isinstance(block, qmqp.MessageBlock):
                    self.received.append(block)
                    held.append(self._reply(block))
                    self.max_unanswered = max(self.max_unanswered, len(held))
                    if self._window is not None and len(held) > self._window:
                        self.violations.append(f"{len(held)} unanswered at {block.id!r}")
                    if self._garbage is not None:
                        conn.sendall(self._garbage)
                        while conn.recv(65536):
                            pass  # until the client closes
                        return
                    if self._answer and len(held) >= self._hold:
                        self._release(conn, held)
                    if self._close_after is not None and len(self.replied) >= self._close_after:
                        conn.shutdown(socket.SHUT_WR)
                        while conn.recv(65536):
                            pass  # until the client closes
                        return
                elif isinstance(block, qmqp.DoneBlock) and self._answer:
                    self._release(conn, held)
                    conn.sendall(qmqp.DONE_BYTES)
                    return

    def _reply(self, block: qmqp.MessageBlock) -> qmqp.ReplyBlock:
        domains = {recipient.rpartition(b"@")[2] for recipient in block.recipients}
        if domains - {b"ok.example", b"down.example"}:
            status, text = qmqp.D, b"no route for " + b",".join(sorted(domains))
        elif b"down.example" in domains:
            status, text = qmqp.Z, b"down.example is down"
        else:
            status, text = qmqp.K, b"queued"
        return qmqp.ReplyBlock(id=block.id, status=status, description=text, pending=0)

    def _release(self, conn: socket.socket, held: list[qmqp.ReplyBlock]) -> None:
        replies = held[::-1]
        held.clear()
        self.replied.extend(reply.id for reply in replies)
        conn.sendall(b"".join(qmqp.encode(reply) for reply in replies))


def mail(ident: str, *recipients: str, body: str = "hello") -> Outgoing:
    """An outgoing message to ``recipients``."""
    return Outgoing(
        id=ident.encode(),
        message=f"Subject: {ident}\n\n{body}\n".encode(),
        envelope=Envelope(
            sender=b"app@example.org", recipients=tuple(r.encode() for r in recipients)
        ),
    )


def run_session(
    server: FakeQMQPServer, items: Iterable[Item], *, window: int = 100, timeout: float = 10.0
) -> Summary:
    """Send ``items`` to ``server`` over one connection; wait for the server to finish."""
    sock = socket.create_connection(server.address, timeout=SERVER_TIMEOUT_SECONDS)
    with QMQPSender(sock, window=window, timeout=timeout) as sender:
        summary = sender.send(items)
    server.join()
    return summary


def test_k_z_d_summary_and_exit_status() -> None:
    """Each reply is counted by status; Z, D and local errors are listed with ids; exit 1."""
    server = FakeQMQPServer()
    summary = run_session(
        server,
        [
            mail("ok1", "a@ok.example"),
            mail("down1", "a@down.example", "b@ok.example"),
            LocalFailure(id=b"bad.eml", reason="no recipient"),
            mail("nowhere1", "a@ok.example", "c@else.example"),
            mail("ok2", "b@ok.example"),
        ],
    )
    assert summary.render() == (
        "K 2, Z 1, D 1, errors 1\n"
        "Z down1: down.example is down\n"
        "D nowhere1: no route for else.example,ok.example\n"
        "error bad.eml: no recipient\n"
    )
    assert summary.exit_status == 1
    assert [block.id for block in server.received] == [b"ok1", b"down1", b"nowhere1", b"ok2"]
    assert server.received[1].recipients == (b"a@down.example", b"b@ok.example")
    assert server.received[1].sender == b"app@example.org"


def test_all_k_exits_zero() -> None:
    """Every message got K: the summary has only counts and the exit status is 0."""
    server = FakeQMQPServer()
    summary = run_session(server, [mail(f"m{i}", "a@ok.example") for i in range(5)])
    assert summary.render() == "K 5, Z 0, D 0, errors 0\n"
    assert summary.exit_status == 0


def test_nothing_to_send_is_a_clean_session() -> None:
    """No messages at all: the done block alone, the server's done block, exit 0."""
    server = FakeQMQPServer()
    summary = run_session(server, [])
    assert summary.exit_status == 0
    assert server.received == []


def test_window_is_full_but_never_exceeded_with_replies_out_of_order() -> None:
    """Window 5: the server sees exactly 5 unanswered, never 6; replies come newest first."""
    server = FakeQMQPServer(hold=5, window=5)
    summary = run_session(server, [mail(f"m{i}", "a@ok.example") for i in range(23)], window=5)
    assert summary.counts == {"K": 23, "Z": 0, "D": 0}
    assert summary.exit_status == 0
    assert server.violations == []
    assert server.max_unanswered == 5
    assert server.replied[:5] == [b"m4", b"m3", b"m2", b"m1", b"m0"]


def test_window_of_one_is_stop_and_wait() -> None:
    """A window of 1 sends the next message only after the last one's reply."""
    server = FakeQMQPServer(hold=1, window=1)
    summary = run_session(server, [mail(f"m{i}", "a@ok.example") for i in range(10)], window=1)
    assert summary.counts["K"] == 10
    assert server.violations == [] and server.max_unanswered == 1


def test_a_server_that_never_answers_gets_exactly_the_window() -> None:
    """A silent server receives 3 blocks of 10 with a window of 3; the time-out reports them."""
    server = FakeQMQPServer(answer=False, window=3)
    items = [mail(f"m{i}", "a@ok.example") for i in range(10)]
    sock = socket.create_connection(server.address, timeout=SERVER_TIMEOUT_SECONDS)
    with QMQPSender(sock, window=3, timeout=0.3) as sender:
        summary = sender.send(items, total=lambda: 10)
    server.join()
    assert [block.id for block in server.received] == [b"m0", b"m1", b"m2"]
    assert server.violations == [] and server.max_unanswered == 3
    assert summary.render() == (
        "K 0, Z 0, D 0, errors 3\n"
        "error m0: no reply: no progress for 0.3 s\n"
        "error m1: no reply: no progress for 0.3 s\n"
        "error m2: no reply: no progress for 0.3 s\n"
        "stopped: no progress for 0.3 s; 7 message(s) not sent\n"
    )
    assert summary.exit_status == 1


def test_server_closing_early_reports_the_unanswered() -> None:
    """A server that closes after 3 replies: 3 K, the rest in flight are errors, the rest unsent."""
    server = FakeQMQPServer(close_after=3)
    items = [mail(f"m{i}", "a@ok.example") for i in range(10)]
    sock = socket.create_connection(server.address, timeout=SERVER_TIMEOUT_SECONDS)
    with QMQPSender(sock, window=2, timeout=10) as sender:
        summary = sender.send(items, total=lambda: 10)
    server.join()
    assert summary.counts["K"] == 3
    unanswered = [ident for kind, ident, _ in summary.failures if kind == "error"]
    assert len(unanswered) <= 2  # none when the close came with the third reply
    assert set(unanswered) <= {"m3", "m4"}
    assert summary.stopped == "the server closed the connection before its done block"
    assert summary.not_sent == 10 - 3 - len(unanswered)
    assert f"; {summary.not_sent} message(s) not sent" in summary.render()
    assert summary.exit_status == 1


def test_a_malformed_reply_ends_the_session() -> None:
    """Bytes that are not a reply: the session stops, saying so; the unanswered are errors."""
    server = FakeQMQPServer(garbage=b"5:hello,")
    summary = run_session(server, [mail("m0", "a@ok.example"), mail("m1", "a@ok.example")])
    assert summary.stopped is not None
    assert summary.stopped.startswith("bad reply from the server: reply framing is broken")
    assert summary.errors == 2 and summary.exit_status == 1
    assert summary.failures[0] == ("error", "m0", f"no reply: {summary.stopped}")


def test_authentication() -> None:
    """The A block goes first and a "1" reply lets the messages through."""
    server = FakeQMQPServer(users={b"me": b"pw"})
    sock = socket.create_connection(server.address, timeout=SERVER_TIMEOUT_SECONDS)
    with QMQPSender(sock, timeout=10) as sender:
        sender.authenticate(b"me", b"pw")
        summary = sender.send([mail("m0", "a@ok.example")])
    server.join()
    assert server.auth == [(b"me", True)]
    assert summary.exit_status == 0


def test_refused_authentication() -> None:
    """A "0" reply raises QMQPAuthRefusedError naming the user; nothing is sent."""
    server = FakeQMQPServer(users={b"me": b"pw"})
    sock = socket.create_connection(server.address, timeout=SERVER_TIMEOUT_SECONDS)
    with QMQPSender(sock, timeout=10) as sender, pytest.raises(QMQPAuthRefusedError, match="me"):
        sender.authenticate(b"me", b"wrong")
    server.join()
    assert server.auth == [(b"me", False)] and server.received == []


@pytest.mark.parametrize(("password", "accepted"), [(b"pw", True), (b"wrong", False)])
def test_auth_success_reply_zero(password: bytes, accepted: bool) -> None:
    """With success_reply "0" (the spec's example) a server saying "0" accepted, "1" refused."""
    server = FakeQMQPServer(users={b"me": b"pw"}, success_digit=b"0")
    sock = socket.create_connection(server.address, timeout=SERVER_TIMEOUT_SECONDS)
    with QMQPSender(sock, timeout=10) as sender:
        if accepted:
            sender.authenticate(b"me", password, success_reply=b"0")
            sender.send([])
        else:
            with pytest.raises(QMQPAuthRefusedError):
                sender.authenticate(b"me", password, success_reply=b"0")
    server.join()
    assert server.auth == [(b"me", accepted)]


def test_over_tls(tmp_path: Path) -> None:
    """The same session over TLS: many blocks in a few batches, replies read meanwhile."""
    pki = make_pki(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(pki.server_cert, pki.server_key)
    server = FakeQMQPServer(hold=7, window=7, context=server_context)
    context = tls_context(ca=str(pki.ca_cert))
    assert context is not None
    sock = connect(("localhost", server.address[1]), context, SERVER_TIMEOUT_SECONDS)
    items = [mail(f"m{i}", "a@ok.example", body="x" * 50_000) for i in range(40)]
    with QMQPSender(sock, window=7, timeout=10) as sender:
        summary = sender.send(items)
    server.join()
    assert summary.counts["K"] == 40 and summary.exit_status == 0
    assert server.violations == []


def test_lazy_input_is_taken_as_the_window_allows() -> None:
    """Messages are taken from the input only as the window opens, not read ahead."""
    server = FakeQMQPServer(hold=2, window=2)
    taken: list[int] = []

    def messages() -> Iterator[Item]:
        for i in range(6):
            taken.append(len(server.received))
            yield mail(f"m{i}", "a@ok.example")

    summary = run_session(server, messages(), window=2)
    assert summary.counts["K"] == 6
    # m2 is taken only after the server has both m0 and m1 (their replies came back).
    assert taken == [0, 0, 2, 2, 4, 4]


# --- the command -----------------------------------------------------------------------------


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run ``msggateway ARGS`` in-process; return status, stdout and stderr."""
    out = io.StringIO()
    err = io.StringIO()
    status = main(list(args), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_cli_sends_a_directory(tmp_path: Path) -> None:
    """``qmqp send ADDRESS DIR``: the summary on stdout, nothing on stderr, exit 1 for a D."""
    write_mails(
        tmp_path / "in",
        {"1.eml": "From: a@example.org\nTo: x@ok.example\n\n1\n",
         "2.eml": "From: a@example.org\nTo: x@else.example\n\n2\n",
         "3.eml": "From: a@example.org\n\nno recipient\n"},
    )  # fmt: skip
    server = FakeQMQPServer()
    host, port = server.address
    status, out, err = run_cli("qmqp", "send", f"{host}:{port}", str(tmp_path / "in"))
    server.join()
    assert (status, err) == (1, "")
    assert out.splitlines()[0] == "K 1, Z 0, D 1, errors 1"
    assert "D 2.eml: no route for else.example" in out
    assert "error 3.eml: no recipient" in out


def test_cli_options(tmp_path: Path) -> None:
    """--address, --sender, --recipient, --id-prefix, --window and --force-progress all apply."""
    write_mails(tmp_path, {"m.eml": "From: a@example.org\nTo: x@else.example\n\nhi\n"})
    server = FakeQMQPServer(window=1, users={b"me": b"pw"})
    host, port = server.address
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QMQP_PASSWORD", "pw")
        status, out, err = run_cli(
            "qmqp", "send", "--address", f"{host}:{port}", str(tmp_path / "m.eml"),
            "--sender", "", "--recipient", "y@ok.example", "--recipient", "z@ok.example",
            "--id-prefix", "t-", "--window", "1", "--force-progress",
            "--username", "me", "--password-env", "QMQP_PASSWORD",
        )  # fmt: skip
    server.join()
    assert (status, out) == (0, "K 1, Z 0, D 0, errors 0\n")
    assert err.endswith("\n") and "answered: 100%" in err and "1/1" in err
    (block,) = server.received
    assert block.id == f"t-{tmp_path / 'm.eml'}".encode()
    assert (block.sender, block.recipients) == (b"", (b"y@ok.example", b"z@ok.example"))


def test_cli_refused_authentication(tmp_path: Path) -> None:
    """A wrong password: exit 1 and the refusal on stderr, no summary."""
    write_mails(tmp_path, {"m.eml": "To: x@ok.example\n\nhi\n"})
    server = FakeQMQPServer(users={b"me": b"pw"})
    host, port = server.address
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QMQP_PASSWORD", "nope")
        status, out, err = run_cli(
            "qmqp", "send", f"{host}:{port}", str(tmp_path),
            "--username", "me", "--password-env", "QMQP_PASSWORD",
        )  # fmt: skip
    server.join()
    assert (status, out) == (1, "")
    assert err == "msggateway: authentication refused for me\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["127.0.0.1:25"], "give at least one PATH after the ADDRESS"),
        (["127.0.0.1:25", "x.eml", "--username", "me"], "--username and --password-env go"),
        (["127.0.0.1:25", "x.eml", "--username", "me", "--password-env", "UNSET_VAR_XYZ"],
         "environment variable UNSET_VAR_XYZ is not set"),
    ],
)  # fmt: skip
def test_cli_usage_errors(args: list[str], message: str) -> None:
    """Usage problems exit 2 with a message on stderr, before anything connects."""
    status, out, err = run_cli("qmqp", "send", *args)
    assert (status, out) == (2, "")
    assert message in err


def test_cli_bad_window_is_an_argparse_error() -> None:
    """--window 0 is refused by argparse: exit status 2."""
    with pytest.raises(SystemExit) as exited:
        run_cli("qmqp", "send", "--window", "0", "127.0.0.1:25", "x.eml")
    assert exited.value.code == 2


def test_cli_cannot_connect(tmp_path: Path) -> None:
    """Nothing listening: exit 1 and a message naming the address."""
    status, out, err = run_cli("qmqp", "send", "127.0.0.1:1", str(tmp_path))
    assert (status, out) == (1, "")
    assert "cannot connect to 127.0.0.1:1" in err


def test_cli_json_prints_one_object_per_message(tmp_path: Path) -> None:
    """--json: one object per message with its id, outcome, status and reason; no summary."""
    write_mails(
        tmp_path,
        {"1.eml": "To: x@ok.example\n\n1\n", "2.eml": "To: x@down.example\n\n2\n",
         "3.eml": "From: a@example.org\n\nno recipient\n"},
    )  # fmt: skip
    server = FakeQMQPServer()
    host, port = server.address
    status, out, err = run_cli("qmqp", "send", "-a", f"{host}:{port}", str(tmp_path), "--json")
    server.join()
    assert (status, err) == (1, "")
    records = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["id"])
    assert [(r["id"], r["outcome"], r["status"]) for r in records] == [
        ("1.eml", "accepted", "K"),
        ("2.eml", "retry", "Z"),
        ("3.eml", "error", "error"),
    ]
    assert records[1]["reason"] == "down.example is down"


def test_cli_count_goes_round_the_files(tmp_path: Path) -> None:
    """--count 5 with two files sends five messages, the repeats with ids made unique."""
    write_mails(tmp_path, {"a.eml": "To: x@ok.example\n\na\n", "b.eml": "To: x@ok.example\n\nb\n"})
    server = FakeQMQPServer()
    host, port = server.address
    status, out, _ = run_cli("qmqp", "send", f"{host}:{port}", str(tmp_path), "--count", "5")
    server.join()
    assert (status, out) == (0, "K 5, Z 0, D 0, errors 0\n")
    assert [block.id for block in server.received] == [
        b"a.eml",
        b"b.eml",
        b"a.eml~2",
        b"b.eml~2",
        b"a.eml~3",
    ]


def test_cli_progress_draws_nothing_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """--progress alone draws only on a terminal: stderr stays empty here."""
    write_mails(tmp_path, {"m.eml": "To: x@ok.example\n\nm\n"})
    server = FakeQMQPServer()
    host, port = server.address
    status, _, err = run_cli("qmqp", "send", f"{host}:{port}", str(tmp_path), "--progress")
    server.join()
    assert (status, err) == (0, "")


def test_cli_bad_address_is_an_argparse_error() -> None:
    """--address that is not HOST:PORT is refused by argparse: exit status 2."""
    with pytest.raises(SystemExit) as exited:
        run_cli("qmqp", "send", "--address", "no-port", "x.eml")
    assert exited.value.code == 2
