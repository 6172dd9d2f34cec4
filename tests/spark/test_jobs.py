"""The archive and report jobs on local[2], from logs written by the gateway's LogStore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.spark import jobs
from tests.spark.conftest import make_log

ORDERS = {"count": 1500, "batch": 100, "publisher": "pub-1"}


def _archived_ids(spark: Any, out: Path) -> list[str]:
    return [r.message_id for r in spark.read.parquet(str(out)).select("message_id").collect()]


def test_archive_is_incremental_and_exactly_once(spark: Any, tmp_path: Path) -> None:
    """Three runs over a growing log: every message once, partitioned by stream and day."""
    log = make_log(tmp_path / "log", {"segment_bytes": 50_000, "streams": {"orders": ORDERS}})
    out = tmp_path / "archive"
    first = jobs.archive(spark, log, out)
    assert first["rows"] == 1500
    assert jobs.archive(spark, log, out)["rows"] == 0
    make_log(log, {"streams": {"orders": {**ORDERS, "count": 200, "first": 1500}}})
    make_log(log, {"streams": {"events": {"count": 40, "batch": 40}}})
    third = jobs.archive(spark, log, out)
    assert third["rows"] == 240
    ids = _archived_ids(spark, out)
    assert len(ids) == len(set(ids)) == 1740
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"stream=orders", "stream=events"}
    day = next((out / "stream=orders").iterdir())
    assert day.name.startswith("day=20")
    state = json.loads((out / jobs.ARCHIVE_STATE).read_text())
    assert state["pending"] is None and state["streams"]["events"] > 0
    row = spark.read.parquet(str(out)).where("message_id = 'orders-42'").collect()[0]
    assert row.body == b"body orders 42".ljust(100, b".") and row.headers == {"n": "42"}


def test_archive_killed_mid_move_is_finished_by_the_next_run(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that dies after recording its pending write is completed, never redone."""
    log = make_log(tmp_path / "log", {"streams": {"orders": {**ORDERS, "count": 300}}})
    out = tmp_path / "archive"
    real_move = jobs._move_staged

    def dies(out_dir: Path, run: str) -> int:
        """Dies."""
        raise OSError("killed")

    monkeypatch.setattr(jobs, "_move_staged", dies)
    with pytest.raises(OSError, match="killed"):
        jobs.archive(spark, log, out)
    assert json.loads((out / jobs.ARCHIVE_STATE).read_text())["pending"] is not None
    monkeypatch.setattr(jobs, "_move_staged", real_move)
    assert jobs.archive(spark, log, out)["rows"] == 0  # the pending run is finished first
    ids = _archived_ids(spark, out)
    assert len(ids) == len(set(ids)) == 300


def test_archive_staging_without_a_record_is_redone(spark: Any, tmp_path: Path) -> None:
    """Files staged by a run killed before its pending record are dropped and written again."""
    log = make_log(tmp_path / "log", {"streams": {"orders": {**ORDERS, "count": 200}}})
    out = tmp_path / "archive"
    stale = out / "_staging" / "dead-run" / "stream=orders" / "day=2026-01-01"
    stale.mkdir(parents=True)
    (stale / "part-0.parquet").write_bytes(b"half written")
    assert jobs.archive(spark, log, out)["rows"] == 200
    assert not (out / "_staging").exists()
    assert len(_archived_ids(spark, out)) == 200


OUTCOMES = [
    # route, source, status, arrived, finished, sender, recipients, bytes
    *[
        [
            "mail-in",
            "mail",
            "accepted",
            3600.0 * 10 + i,
            3600.0 * 10 + i + 0.001 * (i + 1),
            f"s{i % 2}@a.example",
            [f"x@d{i % 3}.example"],
            100,
        ]
        for i in range(90)
    ],
    *[
        [
            "mail-in",
            "mail",
            "retry",
            3600.0 * 11,
            3600.0 * 11 + 0.5,
            "s9@a.example",
            ["y@d0.example"],
            50,
        ]
    ]
    * 7,
    *[
        [
            "mail-in",
            "mail",
            "rejected",
            3600.0 * 11,
            3600.0 * 11 + 0.2,
            "s9@a.example",
            ["z@D0.example"],
            50,
        ]
    ]
    * 3,
    ["alerts", "hub", "accepted", 3600.0 * 12, 3600.0 * 12 + 0.004, "ops", [], 10],
]


def test_report(spark: Any, tmp_path: Path) -> None:
    """Counts, outcomes, latency, hours, top senders and domains: JSON, CSV and PNG."""
    log = make_log(
        tmp_path / "log",
        {"streams": {"orders": {"count": 250, "batch": 50}}, "outcomes": OUTCOMES},
    )
    out = tmp_path / "report"
    document = jobs.report(spark, log, out)
    routes = {r["route"]: r for r in document["routes"]}
    mail = routes["mail-in"]
    assert (mail["messages"], mail["accepted"], mail["retry"], mail["rejected"]) == (100, 90, 7, 3)
    assert mail["bytes"] == 90 * 100 + 10 * 50
    assert 40 <= mail["latency_p50_ms"] <= 51
    assert mail["latency_p99_ms"] == pytest.approx(500, abs=1)
    assert routes["alerts"]["messages"] == 1
    hours = [(h["route"], h["hour"], h["messages"]) for h in document["hourly"]]
    assert ("mail-in", "1970-01-01T10:00:00Z", 90) in hours
    assert ("mail-in", "1970-01-01T11:00:00Z", 10) in hours
    senders = [
        (s["sender"], s["messages"]) for s in document["top_senders"] if s["route"] == "mail-in"
    ]
    assert senders[0] == ("s0@a.example", 45) and ("s9@a.example", 10) in senders
    domains = {
        d["domain"]: d["messages"] for d in document["top_domains"] if d["route"] == "mail-in"
    }
    assert domains["d0.example"] == 30 + 10  # case folded
    assert document["streams"] == [
        {
            "stream": "orders",
            "messages": 250,
            "bytes": 250 * 100,
            "first": document["streams"][0]["first"],
            "last": document["streams"][0]["last"],
        }
    ]
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["routes"] == document["routes"]
    assert (out / "routes.csv").read_text().splitlines()[0].startswith("route,address,messages")
    for chart in ("messages_per_hour", "outcomes", "latency", "top_domains"):
        assert (out / f"{chart}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_window(spark: Any, tmp_path: Path) -> None:
    """--since and --until keep the messages that arrived in between."""
    log = make_log(tmp_path / "log", {"outcomes": OUTCOMES})
    document = jobs.report(
        spark, log, tmp_path / "r", since="1970-01-01T11:00:00", until="1970-01-01T12:00:00"
    )
    assert [(r["route"], r["messages"]) for r in document["routes"]] == [("mail-in", 10)]


DURABLE = {
    "route": "to-far",
    "source": "mail",
    "count": 30,
    "batch": 8,
    "start": 3600.0 * 13,
    "committed": [3600.0 * 13 + 40, 3600.0 * 13 + 40.002],
    "forwarded": 3600.0 * 13 + 41,
    "retried": [2, 9],
    "dead": [5, 17, 29],
}


def _same(new: Any, old: Any) -> None:
    """Report values equal, numbers to within float rounding."""
    if isinstance(new, dict):
        assert new.keys() == old.keys()
        for key in new:
            _same(new[key], old[key])
    elif isinstance(new, list):
        assert len(new) == len(old)
        for a, b in zip(new, old, strict=True):
            _same(a, b)
    elif isinstance(new, float):
        assert new == pytest.approx(old, rel=1e-9, abs=1e-9)
    else:
        assert new == old


def test_durable_ranges_report_as_the_messages_did(spark: Any, tmp_path: Path) -> None:
    """Range records of a durable route report exactly as per-message version 2 records did."""
    direct = OUTCOMES[85:100]  # per-message records of a direct route, beside them
    ranges = make_log(
        tmp_path / "ranges", {"outcomes": direct, "durable": {**DURABLE, "ranges": True}}
    )
    old = make_log(
        tmp_path / "old",
        {"outcomes": direct, "outcome_version": 2, "durable": {**DURABLE, "ranges": False}},
    )
    new_document = jobs.report(spark, ranges, tmp_path / "new-report")
    old_document = jobs.report(spark, old, tmp_path / "old-report")
    for table in ("routes", "hourly", "top_senders", "top_domains"):
        _same(new_document[table], old_document[table])
    streams = [(s["stream"], s["messages"], s["bytes"]) for s in new_document["streams"]]
    assert streams == [("msggateway.route.to-far", 30, sum(range(1, 31)))]
    routes = {(r["route"], r["address"]): r for r in new_document["routes"]}
    far0, far1 = routes["to-far", "far0"], routes["to-far", "far1"]
    assert (far0["messages"], far0["accepted"], far0["forwarded"], far0["dead_lettered"]) == (
        15,
        15,
        15,
        0,
    )
    assert (far1["messages"], far1["forwarded"], far1["dead_lettered"]) == (15, 12, 3)
    assert far0["bytes"] == sum(range(1, 31, 2))
    assert far0["latency_p99_ms"] == pytest.approx(2.0)
    rows = jobs.message_outcomes(spark, ranges).where("message_id = 'd-5'").collect()
    assert sorted((r.kind, r.status, r.reason, r.address) for r in rows) == [
        ("dead-letter", "rejected", "gone", "far1"),
        ("route", "accepted", "", "far1"),
    ]
    [dead] = [r for r in rows if r.kind == "dead-letter"]
    assert dead.latency_ms == pytest.approx((41 + 2 - 5) * 1000.0)
