"""Tests of `gateway.cli.stream`: offsets, the publisher's window and outcomes, the reader.

The publisher and reader are driven by `FakeSession`, which records what
is sent and hands out the frames a test queues: no sockets. The commands
against a real gateway are in tests/integration/test_cli_stream.py.
"""

from __future__ import annotations

import argparse
import io
import json
from collections import deque

import pytest

from gateway.cli.output import Output
from gateway.cli.stream import SUBSCRIPTION_ID, _Publisher, _Reader, parse_offset
from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.codecs.amqp import AMQPMessage, Properties, encode_message
from gateway.protocols.stream.blocking import BlockingStreamClient


class FakeSession(BlockingStreamClient):
    """A session without a socket: `send` records, `next` answers from a queue or a rule.

    Args:
        frame_max: The negotiated frame max.
        answer: Given each Publish sent, the frames the server answers with.
    """

    def __init__(self, *, frame_max: int = 0, answer: object = None) -> None:
        self.frame_max = frame_max
        self.sent: list[sp.Event] = []
        self.queued: deque[sp.Event] = deque()
        self._answer = answer

    def send(self, event: sp.Event) -> None:
        """Record the frame; queue the server's answer to a Publish."""
        self.sent.append(event)
        if isinstance(event, sp.Publish) and callable(self._answer):
            self.queued.extend(self._answer(event))

    def next(self, waiting_for: str) -> sp.Event:
        """The next queued frame."""
        assert self.queued, f"the test queued nothing for {waiting_for}"
        return self.queued.popleft()


def confirm_all(publish: sp.Publish) -> list[sp.Event]:
    """The server confirms every message of a Publish."""
    return [sp.PublishConfirm(publisher_id=1, publishing_ids=list(publish.publishing_ids))]


def publisher(session: FakeSession, out: io.StringIO, first_id: int = 1) -> _Publisher:
    """A publisher printing JSON lines to ``out``."""
    return _Publisher(session, "s", Output(out, json_lines=True), lambda n: None, first_id=first_id)


def records(out: io.StringIO) -> list[dict[str, object]]:
    """The JSON objects printed."""
    return [json.loads(line) for line in out.getvalue().splitlines()]


MOMENT = sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=1_700_000_000_000)
"""2023-11-14T22:13:20Z as a timestamp offset."""


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("first", sp.OffsetSpec(kind=sp.OffsetKind.FIRST)),
        ("last", sp.OffsetSpec(kind=sp.OffsetKind.LAST)),
        ("next", sp.OffsetSpec(kind=sp.OffsetKind.NEXT)),
        ("42", sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=42)),
        ("offset:7", sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=7)),
        ("timestamp:1700000000000", MOMENT),
        ("timestamp:2023-11-14T22:13:20", MOMENT),
        ("timestamp:2023-11-14T23:13:20+01:00", MOMENT),
    ],
)  # fmt: skip
def test_offsets(text: str, spec: sp.OffsetSpec) -> None:
    """Named offsets, numbers, and timestamps in milliseconds or ISO 8601 (UTC by default)."""
    assert parse_offset(text) == spec


@pytest.mark.parametrize("text", ["", "-1", "middle", "timestamp:soon", "offset:x"])
def test_bad_offsets(text: str) -> None:
    """Anything else is a usage error."""
    with pytest.raises(argparse.ArgumentTypeError):
        parse_offset(text)


def test_publish_batches_within_the_window_and_prints_in_order() -> None:
    """Batches of 2, a window of 3: frames never hold more unconfirmed; outcomes in id order."""
    session = FakeSession(answer=confirm_all)
    out = io.StringIO()
    failed = publisher(session, out, first_id=10).run(
        [b"a", b"b", b"c", b"d", b"e"], window=3, batch=2
    )
    assert not failed
    frames = [event for event in session.sent if isinstance(event, sp.Publish)]
    assert [list(frame.publishing_ids) for frame in frames] == [[10, 11], [12], [13, 14]]
    assert [(r["message"], r["publishing_id"], r["outcome"]) for r in records(out)] == [
        (1, 10, "accepted"), (2, 11, "accepted"), (3, 12, "accepted"),
        (4, 13, "accepted"), (5, 14, "accepted"),
    ]  # fmt: skip


def test_publish_errors_retry_or_reject_by_code() -> None:
    """Code 6 (not available) is retry later, 2 (no stream) rejected; confirms out of order."""

    def answer(publish: sp.Publish) -> list[sp.Event]:
        return [
            sp.PublishConfirm(publisher_id=1, publishing_ids=[3]),
            sp.PublishError(publisher_id=1, publishing_ids=[1, 2], codes=[6, 2]),
        ]

    session = FakeSession(answer=answer)
    out = io.StringIO()
    assert publisher(session, out).run([b"a", b"b", b"c"], window=10, batch=10)
    assert [(r["outcome"], r.get("code"), r.get("reason")) for r in records(out)] == [
        ("retry", 6, "stream not available"),
        ("rejected", 2, "stream does not exist"),
        ("accepted", None, None),
    ]


def test_a_message_over_the_frame_max_is_an_error_of_its_own() -> None:
    """A body that cannot fit a Publish frame is not sent; the others are, in smaller frames."""
    session = FakeSession(frame_max=60, answer=confirm_all)
    out = io.StringIO()
    assert publisher(session, out).run([b"x" * 20, b"y" * 100, b"z" * 20], window=10, batch=10)
    frames = [event for event in session.sent if isinstance(event, sp.Publish)]
    assert [list(frame.publishing_ids) for frame in frames] == [[1], [3]]
    outcomes = [(r["outcome"], r.get("reason")) for r in records(out)]
    assert outcomes[0] == outcomes[2] == ("accepted", None)
    assert outcomes[1] == ("error", "100 bytes do not fit the frame max of 60")


def deliver(first_offset: int, entries: list[bytes], chunk_type: int = osiris.USER) -> sp.Deliver:
    """A Deliver of one chunk, as the server sends it."""
    chunk = osiris.encode_chunk(
        entries, first_offset=first_offset, timestamp_ms=1_700_000_000_000, chunk_type=chunk_type
    )
    return sp.Deliver(subscription_id=SUBSCRIPTION_ID, chunk=chunk)


def test_reader_skips_below_the_offset_and_stops_after_the_end_chunk() -> None:
    """Entries before the asked offset are skipped; the chunk at the end is the last read."""
    session = FakeSession()
    amqp = encode_message(AMQPMessage(properties=Properties(message_id="m-3"), body=b"three"))
    session.queued.extend(
        [deliver(0, [b"zero", b"one", b"two"]), deliver(3, [amqp, b"four"]), deliver(5, [b"x"])]
    )
    out = io.StringIO()
    _Reader("s", Output(out, json_lines=True), lambda n: None).read(
        session, skip_below=1, end=3, count=0
    )
    assert [(r["offset"], r["id"], r["body"]) for r in records(out)] == [
        (1, "s:1", "one"), (2, "s:2", "two"), (3, "m-3", "three"), (4, "s:4", "four"),
    ]  # fmt: skip
    assert records(out)[0]["timestamp"] == 1_700_000_000.0
    credits = [event for event in session.sent if isinstance(event, sp.Credit)]
    assert len(credits) == 1  # after the first chunk; none after the last one read
    assert len(session.queued) == 1


def test_reader_stops_at_the_count_and_passes_tracking_chunks() -> None:
    """--count ends the reading mid-chunk; a tracking chunk prints nothing."""
    session = FakeSession()
    tracking = osiris.encode_tracking({"p": 1}, {})
    session.queued.extend(
        [deliver(0, [tracking], osiris.TRACKING_DELTA), deliver(1, [b"a", b"b", b"c"])]
    )
    out = io.StringIO()
    _Reader("s", Output(out, json_lines=False), lambda n: None).read(
        session, skip_below=0, end=None, count=2
    )
    assert out.getvalue() == "1 a\n2 b\n"
