"""The outcome record: the router's records, batching, bounds, and what lands in the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.task import Clock

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
    }
    with pytest.raises(ValueError, match="not a version 2 outcome entry"):
        decode_records(b'[1, "x"]')
    with pytest.raises(ValueError, match="without its 13 fields"):
        decode_records(b'[2, [["route"]]]')


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
    """A durable route's forwarder reports deliveries and dead letters as their own kinds."""
    store = open_store(tmp_path)
    try:
        clock = Clock()
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
        settled = recorder.forwarded("durable-route")
        message = Message(body=b"abc", address="far", timestamp=5.0)
        clock.advance(7)
        settled(message, Outcome.accepted(), False)
        settled(message, Outcome.rejected("gone"), True)
        await recorder.flush()
        kinds = _logged(tmp_path)
        assert [(r["kind"], r["route"], r["source"]) for r in kinds] == [
            (KIND_FORWARD, "durable-route", "log"),
            (KIND_DEAD_LETTER, "durable-route", "log"),
        ]
        assert kinds[0]["arrived"] == 5.0 and kinds[0]["finished"] == 7.0
    finally:
        await store.close()
