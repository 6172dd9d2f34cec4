"""Tests of `gateway.cli.qmqp` and ``msggateway qmqp send``.

Envelopes, identifiers and the reading of files, directories and mbox files
are checked on small files in ``tmp_path``. The session is checked against
`FakeQMQPServer`, a small real QMQP streaming server made of our own codec in
a background thread on 127.0.0.1 port 0: it answers by recipient domain,
holds replies to answer them out of order, and checks the window.
"""

from __future__ import annotations

import io
import socket
import ssl
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.cli.qmqp import (
    Envelope,
    Item,
    LocalFailure,
    MailSource,
    Outgoing,
    Progress,
    ProgressBar,
    QMQPAuthRefusedError,
    QMQPSender,
    Summary,
    envelope_of,
    prepare,
)
from gateway.cli.ssmp import connect, tls_context
from gateway.codecs import qmqp
from tests.certs import make_pki

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


def write_mails(directory: Path, mails: dict[str, str]) -> None:
    """Write message files (their text gets LF lines as given)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in mails.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())


# --- envelopes -------------------------------------------------------------------------


def test_envelope_from_headers() -> None:
    """Without options: the From address is the sender, To, Cc and Bcc the recipients."""
    message = (
        b'From: "Ops, Team" <ops@example.org>\n'
        b"To: Alice <alice@ok.example>, bob@ok.example\n"
        b"Cc: =?utf-8?q?J=C3=B6rg?= <jorg@ok.example>\n"
        b"Bcc: hidden@ok.example\n"
        b"Subject: hi\n\nTo: body@not.a.header\n"
    )
    assert envelope_of(message) == Envelope(
        sender=b"ops@example.org",
        recipients=(
            b"alice@ok.example",
            b"bob@ok.example",
            b"jorg@ok.example",
            b"hidden@ok.example",
        ),
    )


def test_folded_and_crlf_headers() -> None:
    """Folded address lists and CRLF lines are read like plain ones."""
    message = b"From: a@example.org\r\nTo: one@ok.example,\r\n two@ok.example\r\n\r\nbody\r\n"
    assert envelope_of(message).recipients == (b"one@ok.example", b"two@ok.example")


def test_return_path_wins_over_from() -> None:
    """Return-Path gives the sender when present; ``<>`` there is the null sender."""
    head = b"From: from@example.org\nTo: x@ok.example\n"
    assert (
        envelope_of(b"Return-Path: <bounce@example.org>\n" + head).sender == b"bounce@example.org"
    )
    assert envelope_of(b"Return-Path: <>\n" + head).sender == b""
    assert envelope_of(b"To: x@ok.example\n\n").sender == b""


def test_options_override_headers() -> None:
    """--sender and --recipient replace what the headers say, not add to it."""
    message = b"Return-Path: <r@example.org>\nFrom: f@example.org\nTo: t@ok.example\n\n"
    found = envelope_of(message, sender="", recipients=["one@ok.example", "two@ok.example"])
    assert found == Envelope(sender=b"", recipients=(b"one@ok.example", b"two@ok.example"))


def test_recipients_are_deduplicated() -> None:
    """An address in To, Cc and Bcc is sent to once; domains compare without case."""
    message = (
        b"From: a@example.org\nTo: x@ok.example, Y@ok.example\nCc: X <x@OK.example>\n"
        b"Bcc: x@ok.example, y@ok.example\n\n"
    )
    assert envelope_of(message).recipients == (b"x@ok.example", b"Y@ok.example", b"y@ok.example")


def test_non_ascii_address_bytes_are_kept() -> None:
    """Raw UTF-8 in an address reaches the envelope as the same bytes."""
    message = "From: Jörg <jörg@example.org>\nTo: ännchen@ok.example\n\n".encode()
    assert envelope_of(message) == Envelope(
        sender="jörg@example.org".encode(), recipients=("ännchen@ok.example".encode(),)
    )


def test_no_recipient_is_a_local_failure() -> None:
    """A message without any recipient is not sent: it becomes a LocalFailure."""
    found = prepare(b"m1", b"From: a@example.org\nTo: undisclosed-recipients:;\n\nhi\n")
    assert isinstance(found, LocalFailure)
    assert found.id == b"m1"
    assert "no recipient" in found.reason


def test_crlf_becomes_lf_and_other_bytes_stay() -> None:
    """CRLF lines become LF lines; every other byte, 8-bit included, is kept."""
    data = b"From: a@example.org\r\nTo: b@ok.example\r\n\r\n\xff\xfe caf\xc3\xa9\rx\r\n"
    found = prepare(b"m1", data)
    assert isinstance(found, Outgoing)
    assert found.message == b"From: a@example.org\nTo: b@ok.example\n\n\xff\xfe caf\xc3\xa9\rx\n"


# --- reading paths -----------------------------------------------------------------------


def ids_of(items: Iterable[Item]) -> list[str]:
    """The identifiers, as text."""
    return [item.id.decode() for item in items]


def test_directory_is_read_sorted_and_not_recursively(tmp_path: Path) -> None:
    """Every regular file of a directory, in name order, named by its relative path."""
    write_mails(
        tmp_path / "in",
        {"b.eml": "To: b@ok.example\n\nb\n", "a.eml": "To: a@ok.example\n\na\n",
         "sub/c.eml": "To: c@ok.example\n\nc\n"},
    )  # fmt: skip
    source = MailSource([tmp_path / "in"])
    assert source.total == 2
    items = list(source)
    assert ids_of(items) == ["a.eml", "b.eml"]
    assert all(isinstance(item, Outgoing) for item in items)
    deep = MailSource([tmp_path / "in"], recursive=True)
    assert ids_of(deep) == ["a.eml", "b.eml", "sub/c.eml"]


def test_file_ids_are_paths_as_given_and_unique(tmp_path: Path) -> None:
    """A file is named as given; repeated names get ~2, ~3; the prefix comes first."""
    write_mails(tmp_path / "one", {"m.eml": "To: a@ok.example\n\n"})
    write_mails(tmp_path / "two", {"m.eml": "To: a@ok.example\n\n"})
    single = str(tmp_path / "one" / "m.eml")
    source = MailSource([tmp_path / "one", tmp_path / "two", single, tmp_path / "one"])
    assert ids_of(source) == ["m.eml", "m.eml~2", single, "m.eml~3"]
    prefixed = MailSource([tmp_path / "one", tmp_path / "two"], id_prefix="run7/")
    assert ids_of(prefixed) == ["run7/m.eml", "run7/m.eml~2"]


MBOX = (
    "From alice@example.org Mon Jan  1 00:00:00 2024\n"
    "From: alice@example.org\nTo: x@ok.example\nSubject: one\n\nfirst\n\n"
    "From bob@example.org Mon Jan  1 00:00:01 2024\n"
    "From: bob@example.org\nTo: y@ok.example\nSubject: two\n\nsecond\n\n"
    "From nobody Mon Jan  1 00:00:02 2024\n"
    "From: nobody@example.org\nSubject: three\n\nno recipient\n"
)


def test_mbox_is_detected_and_split(tmp_path: Path) -> None:
    """A file starting with "From " is an mbox: mbox:N ids, no From line sent."""
    (tmp_path / "box").write_bytes(MBOX.encode())
    source = MailSource([tmp_path / "box"])
    assert source.total is None  # known once the mbox is opened
    items = iter(source)
    first = next(items)
    assert source.total == 3
    rest = list(items)
    assert ids_of([first, *rest]) == ["mbox:1", "mbox:2", "mbox:3"]
    assert isinstance(first, Outgoing)
    assert first.message == b"From: alice@example.org\nTo: x@ok.example\nSubject: one\n\nfirst\n"
    assert first.envelope == Envelope(sender=b"alice@example.org", recipients=(b"x@ok.example",))
    assert isinstance(rest[1], LocalFailure) and "no recipient" in rest[1].reason


def test_crlf_mbox(tmp_path: Path) -> None:
    """An mbox with CRLF lines gives LF messages."""
    (tmp_path / "box").write_bytes(MBOX.replace("\n", "\r\n").encode())
    first = next(iter(MailSource([tmp_path / "box"])))
    assert isinstance(first, Outgoing)
    assert first.message.startswith(b"From: alice@example.org\nTo: x@ok.example\n")
    assert b"\r" not in first.message


def test_two_mboxes_get_unique_ids(tmp_path: Path) -> None:
    """The second mbox's messages are mbox:N~2."""
    (tmp_path / "a").write_bytes(MBOX.encode())
    (tmp_path / "b").write_bytes(MBOX.encode())
    source = MailSource([tmp_path / "a", tmp_path / "b"])
    assert ids_of(source)[2:5] == ["mbox:3", "mbox:1~2", "mbox:2~2"]
    assert source.total == 6


def test_forced_mbox(tmp_path: Path) -> None:
    """--mbox reads a file as an mbox, and refuses one that is not; an empty one is empty."""
    write_mails(tmp_path, {"box.txt": MBOX, "plain.eml": "To: a@ok.example\n\n", "empty": ""})
    items = list(MailSource([tmp_path], mbox=True))
    assert ids_of(items) == ["mbox:1", "mbox:2", "mbox:3", "plain.eml"]
    assert isinstance(items[3], LocalFailure) and "not an mbox" in items[3].reason


def test_missing_and_unreadable_paths_are_local_failures(tmp_path: Path) -> None:
    """A missing path, or a file gone before it is read, is one failure, not a crash."""
    write_mails(tmp_path, {"gone.eml": "To: a@ok.example\n\n"})
    source = MailSource([tmp_path / "nope.eml", tmp_path / "gone.eml"])
    (tmp_path / "gone.eml").unlink()
    items = list(source)
    assert ids_of(items) == [str(tmp_path / "nope.eml"), str(tmp_path / "gone.eml")]
    assert items == [
        LocalFailure(id=items[0].id, reason="no such file or directory"),
        LocalFailure(id=items[1].id, reason="cannot read: No such file or directory"),
    ]


# --- the session ---------------------------------------------------------------------------


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


# --- progress ------------------------------------------------------------------------------


class ManualClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_bar_redraws_at_most_ten_times_a_second() -> None:
    """Reports within 0.1 s of the last redraw are skipped; the last one always draws."""
    stream = io.StringIO()
    clock = ManualClock()
    bar = ProgressBar(stream, total=lambda: 200, clock=clock)
    bar(Progress(sent=10, answered=0, failed=0, elapsed=0.0))
    clock.now = 0.05
    bar(Progress(sent=20, answered=10, failed=0, elapsed=0.05))
    clock.now = 0.1
    bar(Progress(sent=100, answered=50, failed=2, elapsed=0.1))
    clock.now = 0.12
    bar(Progress(sent=198, answered=198, failed=2, elapsed=0.12, finished=True))
    assert stream.getvalue().split("\r")[1:] == [
        "sent 10, answered 0 of 200 (0%), 0 msg/s",
        "sent 100, answered 50 of 200 (26%), 2 not sendable, 500 msg/s",
        "sent 198, answered 198 of 200 (100%), 2 not sendable, 1650 msg/s\n",
    ]


def test_progress_bar_without_a_total_pads_shorter_lines() -> None:
    """An unknown total is left out; a shorter line blanks what the longer one left."""
    stream = io.StringIO()
    bar = ProgressBar(stream, clock=ManualClock(), interval=0.0)
    bar(Progress(sent=1000, answered=1000, failed=5, elapsed=1.0))
    bar(Progress(sent=1, answered=1, failed=0, elapsed=1.0))
    first, second = stream.getvalue().split("\r")[1:]
    assert first == "sent 1000, answered 1000, 5 not sendable, 1000 msg/s"
    assert second.startswith("sent 1, answered 1, 1 msg/s") and len(second) == len(first)


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
    """--address, --sender, --recipient, --id-prefix, --window and --progress all apply."""
    write_mails(tmp_path, {"m.eml": "From: a@example.org\nTo: x@else.example\n\nhi\n"})
    server = FakeQMQPServer(window=1, users={b"me": b"pw"})
    host, port = server.address
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QMQP_PASSWORD", "pw")
        status, out, err = run_cli(
            "qmqp", "send", "--address", f"{host}:{port}", str(tmp_path / "m.eml"),
            "--sender", "", "--recipient", "y@ok.example", "--recipient", "z@ok.example",
            "--id-prefix", "t-", "--window", "1", "--progress",
            "--username", "me", "--password-env", "QMQP_PASSWORD",
        )  # fmt: skip
    server.join()
    assert (status, out) == (0, "K 1, Z 0, D 0, errors 0\n")
    assert err.endswith("\n") and "sent 1, answered 1 of 1 (100%)" in err
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
        (["127.0.0.1:25"], "give ADDRESS (or --address) and at least one PATH"),
        (["no-port", "x.eml"], "'no-port' is not HOST:PORT"),
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


def test_bcc_header_is_removed_but_its_addresses_receive() -> None:
    """Bcc recipients are in the envelope, but the Bcc header is not sent."""
    data = (
        b"From: a@example.org\nTo: b@example.org\nBcc: c@example.org,\n d@example.org\n"
        b"Subject: hi\n\nBcc: this line is in the body\n"
    )
    item = prepare(b"m1", data)
    assert isinstance(item, Outgoing)
    assert item.envelope.recipients == (b"b@example.org", b"c@example.org", b"d@example.org")
    assert item.message == (
        b"From: a@example.org\nTo: b@example.org\nSubject: hi\n\nBcc: this line is in the body\n"
    )
