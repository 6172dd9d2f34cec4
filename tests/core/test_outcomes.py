"""The outcome record: the router's records, batching, bounds, and what lands in the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from gateway.core.forwarder import Forwarded, ForwardedException
from gateway.core.message import Message, Outcome
from gateway.core.outcomes import (
    KIND_DEAD_LETTER,
    KIND_FORWARD,
    OUTCOME_STREAM,
    RECORDS_PER_ENTRY,
    OutcomeRecorder,
    decode_records,
    encode_records,
    outcome_row,
    range_row,
)
from gateway.spark.logfiles import plan_slices, read_slice
from tests.core.test_log import open_store
from tests.core.test_router import _AnsweringDestination, _dispatch, _result, _route, _router


def _logged(directory: Path) -> list[dict[str, Any]]:
    """The records in the log's outcome stream, read from its files."""
    return [
        record
        for piece in plan_slices(directory, streams=[OUTCOME_STREAM])
        for chunk in read_slice(piece)
        for entry in chunk.records
        for record in decode_records(entry)
    ]


def test_record_round_trip() -> None:
    """Every field survives encoding, non-ASCII and surrogate escapes included."""
    message = Message(
        body=b"12345",
        address="inbox",
        id="m-\udcff",
        sender="s\u00e9@example.org",
        recipients=("a@x.example", "b@y.example"),
    )
    [record] = decode_records(
        encode_records(
            [outcome_row("route", "r", "mail", message, 10.5, Outcome.retry("busy", "451"), 10.75)]
        )
    )
    assert record == {
        "kind": "route",
        "route": "r",
        "source": "mail",
        "id": "m-\udcff",
        "address": "inbox",
        "sender": "s\u00e9@example.org",
        "recipients": ["a@x.example", "b@y.example"],
        "bytes": 5,
        "arrived": 10.5,
        "status": "retry",
        "code": "451",
        "reason": "busy",
        "finished": 10.75,
        "stream": None,
        "first": None,
        "last": None,
        "exceptions": [],
    }
    with pytest.raises(ValueError, match="not a version 2 or 3 outcome entry"):
        decode_records(b'[1, "x"]')
    with pytest.raises(ValueError, match="without its 13 fields"):
        decode_records(b'[2, [["route"]]]')
    with pytest.raises(ValueError, match="without its 17 fields"):
        decode_records(b'[3, [["route"]]]')


def test_range_record_round_trip() -> None:
    """A range record keeps its stream, offsets, outcome and every exception."""
    row = range_row(
        KIND_FORWARD,
        "r",
        "log",
        "msggateway.route.r",
        10,
        19,
        5.0,
        Outcome.accepted(),
        7.5,
        [(12, KIND_DEAD_LETTER, "rejected", "550", "no such mailbox", 9_000_000, 3)],
    )
    [record] = decode_records(encode_records([row]))
    assert record == {
        "kind": "forward",
        "route": "r",
        "source": "log",
        "id": None,
        "address": None,
        "sender": None,
        "recipients": None,
        "bytes": None,
        "arrived": 5.0,
        "status": "accepted",
        "code": None,
        "reason": "",
        "finished": 7.5,
        "stream": "msggateway.route.r",
        "first": 10,
        "last": 19,
        "exceptions": [
            {
                "offset": 12,
                "kind": "dead-letter",
                "status": "rejected",
                "code": "550",
                "reason": "no such mailbox",
                "finished": 9.0,
                "attempts": 3,
            }
        ],
    }
    with pytest.raises(ValueError, match="exception without its 7 fields"):
        decode_records(encode_records([(*row[:-1], [[12]])]))


def test_version_2_records_still_decode() -> None:
    """An entry the previous release wrote reads as per-message records without a range."""
    entry = (
        b'[2,[["route","r","mail","m1","inbox","a@b.example",["x@y.example"],5,'
        b'10500000,"retry","451","busy",10750000],'
        b'["forward","r","log","m2","far",null,[],3,5000000,"accepted",null,"",7000000]]]'
    )
    routed, forwarded = decode_records(entry)
    assert (routed["id"], routed["recipients"], routed["bytes"]) == ("m1", ["x@y.example"], 5)
    assert (routed["arrived"], routed["finished"], routed["code"]) == (10.5, 10.75, "451")
    assert (forwarded["kind"], forwarded["sender"], forwarded["finished"]) == ("forward", None, 7.0)
    for record in (routed, forwarded):
        assert (record["stream"], record["first"], record["last"]) == (None, None, None)
        assert record["exceptions"] == []


@pytest_twisted.ensureDeferred
async def test_router_records_each_route_outcome(tmp_path: Path) -> None:
    """Route, source, destination address, times and outcome of every dispatched message."""
    store = open_store(tmp_path)
    try:
        router, clock, _ = _router(
            [
                _route("ok", "weather.*", address="central.{1}"),
                _route("no", "alerts.*", destination="refuser"),
            ],
            _AnsweringDestination("central"),
            _AnsweringDestination("refuser", Outcome.rejected("no such feed", "404")),
        )
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
        router.recorder = recorder
        clock.advance(100)
        assert _result(_dispatch(router, "weather.oslo", b"23C")).is_accepted
        assert not _result(_dispatch(router, "alerts.fire")).is_accepted
        await recorder.flush()
        assert recorder.recorded == 2
        ok, no = _logged(tmp_path)
        assert (ok["route"], ok["source"], ok["address"], ok["status"]) == (
            "ok",
            "hub",
            "central.oslo",
            "accepted",
        )
        assert ok["bytes"] == 3 and ok["arrived"] == ok["finished"] == 100.0
        assert (no["route"], no["status"], no["code"], no["reason"]) == (
            "no",
            "rejected",
            "404",
            "no such feed",
        )
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_batches_by_interval_and_size(tmp_path: Path) -> None:
    """Records wait at most the interval, or until a batch is full."""
    store = open_store(tmp_path)
    try:
        clock = Clock()
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock, interval=0.5, batch=3)
        message = Message(body=b"x", address="a")
        recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
        clock.advance(0.49)
        assert recorder.recorded == 0 and recorder.flush is not None
        assert len(recorder._waiting) == 1
        clock.advance(0.01)
        assert recorder._waiting == []  # appended: the timer fired
        for _ in range(3):
            recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
        assert recorder._waiting == []  # a full batch goes at once
        assert not clock.getDelayedCalls()
        assert recorder.flush() is None  # nothing waits
        await store.close()
        assert recorder.recorded == 4
        assert len(_logged(tmp_path)) == 4
    finally:
        if store.get(OUTCOME_STREAM) is not None:
            await store.close()


@pytest_twisted.ensureDeferred
async def test_many_records_per_entry(tmp_path: Path) -> None:
    """A flush of 2,500 records is three entries (three offsets), every record kept."""
    store = open_store(tmp_path)
    try:
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), Clock())
        for number in range(2500):
            message = Message(body=b"x", address="a", id=f"m{number}")
            recorder.record("route", "r", "s", message, 1.0, Outcome.accepted())
        await recorder.flush()
        entries = [
            entry
            for piece in plan_slices(tmp_path, streams=[OUTCOME_STREAM])
            for chunk in read_slice(piece)
            for entry in chunk.records
        ]
        assert len(entries) == -(-2500 // RECORDS_PER_ENTRY)
        assert [r["id"] for r in _logged(tmp_path)] == [f"m{n}" for n in range(2500)]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_bounded_and_dropped_when_the_log_refuses(tmp_path: Path) -> None:
    """Past max_pending, and when the log cannot write, records are dropped and counted."""
    store = open_store(tmp_path)
    stream = store.create(OUTCOME_STREAM)
    clock = Clock()
    recorder = OutcomeRecorder(stream, clock, max_pending=2)
    message = Message(body=b"x", address="a")
    for _ in range(3):
        recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
    assert recorder.dropped == 1
    await recorder.flush()
    assert recorder.recorded == 2
    await store.close()
    recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
    await recorder.flush()
    assert recorder.dropped == 2 and recorder.recorded == 2


@pytest_twisted.ensureDeferred
async def test_forwarder_records(tmp_path: Path) -> None:
    """A forwarded chunk is one range record; retried and dead-lettered offsets are listed."""
    store = open_store(tmp_path)
    try:
        clock = Clock()
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
        report = recorder.forwarded("durable-route", "msggateway.route.durable-route")
        report(
            Forwarded(
                4,
                9,
                5.0,
                7.0,
                (
                    ForwardedException(5, False, Outcome.retry("busy", "451"), 2, 8.0),
                    ForwardedException(6, True, Outcome.rejected("gone"), 5, 9.5),
                ),
            )
        )
        report(Forwarded(10, 10, 6.0, 7.25))
        await recorder.flush()
        assert recorder.recorded == 2
        first, second = _logged(tmp_path)
        assert [(r["kind"], r["route"], r["source"], r["status"]) for r in (first, second)] == [
            (KIND_FORWARD, "durable-route", "log", "accepted"),
            (KIND_FORWARD, "durable-route", "log", "accepted"),
        ]
        assert first["stream"] == "msggateway.route.durable-route"
        assert (first["first"], first["last"], first["arrived"], first["finished"]) == (4, 9, 5, 7)
        assert [
            (e["offset"], e["kind"], e["status"], e["code"], e["reason"], e["finished"])
            for e in first["exceptions"]
        ] == [
            (5, KIND_FORWARD, "accepted", "451", "busy", 8.0),
            (6, KIND_DEAD_LETTER, "rejected", None, "gone", 9.5),
        ]
        assert [e["attempts"] for e in first["exceptions"]] == [2, 5]
        assert (second["first"], second["last"], second["exceptions"]) == (10, 10, [])
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_batch_is_one_call_and_bounded_as_a_whole(tmp_path: Path) -> None:
    """One record per message of a batch, with the batch's times; past the bound, what fits."""
    store = open_store(tmp_path)
    try:
        clock = Clock()
        clock.advance(3)
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock, max_pending=3)
        batch = [Message(body=b"x" * n, address=f"a{n}", id=f"m{n}") for n in range(1, 5)]
        outcomes = [
            Outcome.accepted(),
            Outcome.retry("busy"),
            Outcome.accepted(),
            Outcome.accepted(),
        ]
        recorder.record_batch("route", "r", "s", batch, 2.0, outcomes)
        assert recorder.dropped == 1
        await recorder.flush()
        logged = _logged(tmp_path)
        assert [(r["id"], r["address"], r["bytes"], r["status"]) for r in logged] == [
            ("m1", "a1", 1, "accepted"),
            ("m2", "a2", 2, "retry"),
            ("m3", "a3", 3, "accepted"),
        ]
        assert {(r["arrived"], r["finished"]) for r in logged} == {(2.0, 3.0)}
    finally:
        await store.close()
