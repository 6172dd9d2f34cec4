"""Tests of `gateway.cli.qmqp.mail`: what ``msggateway qmqp send`` reads and sends.

Envelopes from headers and options, identifiers, the Bcc header, and the
reading of files, directories and mbox files, on small files in ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gateway.cli.qmqp.mail import (
    Envelope,
    Item,
    LocalFailure,
    MailSource,
    Outgoing,
    envelope_of,
    prepare,
)


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
