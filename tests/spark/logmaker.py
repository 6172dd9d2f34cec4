"""Write a log with the gateway's own LogStore, in a child process (the tests' data).

``python -m tests.spark.logmaker DIRECTORY SPEC`` where SPEC is JSON:
``{"segment_bytes": N, "streams": {"name": {"count": N, "batch": N,
"publisher": "ref" | null, "start": T}}, "outcomes": [[route, source, status,
arrived, finished, sender, [recipients], bytes], ...], "outcome_version": 2 |
3, "durable": {...}}``. Message ``i`` of stream ``s`` has id ``s-i``, body
``body s i`` padded to 100 bytes, sender ``sender{i % 3}@example.org``,
recipients ``r{i % 2}@domain{i % 4}.example``, header ``n = i`` and
timestamp ``start + i``. Appends of ``batch`` messages are awaited one after
another, so each is one chunk.

``outcomes`` are per-message records, as the current release writes them,
or (``"outcome_version": 2``) as the previous one did.

``durable``: ``{"route": R, "source": S, "count": N, "batch": B, "start": T,
"committed": [arrived, finished], "forwarded": F, "retried": [i, ...],
"dead": [i, ...], "ranges": true | false}`` writes what a durable route
leaves: its stream ``msggateway.route.R`` (message ``i``: id ``d-i``,
address ``far{i % 2}``, body ``i + 1`` bytes, sender ``s{i % 3}@near.example``,
recipients ``x@d{i % 4}.example``, timestamp ``T + i``; appends of B), and its
outcome records: with ``ranges``, one range record per append (committed
between the two times) and per chunk forwarded (at F; the ``retried`` ones
accepted at F + 1 after a ``busy`` retry, the ``dead`` ones dead-lettered at
F + 2); without, the same as per-message version 2 records, as the
previous release wrote them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred

from gateway.core.durable import route_stream_name
from gateway.core.log import LogStore, Retention
from gateway.core.message import Message, Outcome, Status
from gateway.core.outcomes import (
    KIND_DEAD_LETTER,
    KIND_FORWARD,
    KIND_ROUTE,
    OUTCOME_STREAM,
    encode_records,
    outcome_row,
    range_row,
)
from gateway.protocols.stream.mapping import entry_from_message

_BUSY = Outcome.retry("busy", "451")
_GONE = Outcome.rejected("gone", "550")


def message(stream: str, i: int, start: float) -> Message:
    """Message ``i`` of a stream, as described in the module documentation."""
    return Message(
        body=f"body {stream} {i}".encode().ljust(100, b"."),
        address=stream,
        id=f"{stream}-{i}",
        sender=f"sender{i % 3}@example.org",
        recipients=(f"r{i % 2}@domain{i % 4}.example",),
        headers={"n": i},
        timestamp=start + i,
    )


async def write(reactor: Any, directory: str, spec: dict[str, Any]) -> None:
    """Write the log the spec describes, then close it cleanly."""
    store = LogStore(
        Path(directory),
        reactor,
        default_retention=Retention(max_segment_bytes=spec.get("segment_bytes", 64 << 20)),
    )
    store.open()
    for name, wanted in spec.get("streams", {}).items():
        stream = store.get(name) or store.create(name)
        count, batch = wanted["count"], wanted.get("batch", 1000)
        publisher, start = wanted.get("publisher"), wanted.get("start", 1_700_000_000.0)
        first = wanted.get("first", 0)
        for low in range(first, first + count, batch):
            high = min(low + batch, first + count)
            entries = [entry_from_message(message(name, i, start)) for i in range(low, high)]
            if publisher:
                ids = list(range(low + 1, high + 1))
                await stream.append(entries, reference=publisher, publishing_ids=ids)
            else:
                await stream.append(entries)
    rows: list[tuple[Any, ...]] = []
    durable = spec.get("durable")
    if durable:
        rows.extend(await _durable(store, durable))
    records = spec.get("outcomes", [])
    if records or rows:
        stream = store.get(OUTCOME_STREAM) or store.create(OUTCOME_STREAM)
        entries = rows
        for number, (route, source, status, arrived, finished, sender, rcpts, size) in enumerate(
            records
        ):
            sent = Message(
                body=b"x" * size,
                address=f"dest-{route}",
                id=f"o-{number}",
                sender=sender,
                recipients=tuple(rcpts),
            )
            outcome = Outcome(Status(status), "" if status == "accepted" else "why", None)
            entries.append(outcome_row(KIND_ROUTE, route, source, sent, arrived, outcome, finished))
        encode = _v2_entry if spec.get("outcome_version") == 2 else encode_records
        # Entries of up to 7 records: several per entry, several entries.
        await stream.append([encode(entries[at : at + 7]) for at in range(0, len(entries), 7)])
    await store.close()


def _v2_entry(rows: list[tuple[Any, ...]]) -> bytes:
    """An entry as the previous release wrote it: version 2, per-message records of 13 fields."""
    assert all(row[13] is None for row in rows), "version 2 has no range records"
    return json.dumps([2, [row[:13] for row in rows]], ensure_ascii=False).encode()


def durable_message(i: int, start: float) -> Message:
    """Message ``i`` of a durable route, as the module documentation describes."""
    return Message(
        body=b"b" * (i + 1),
        address=f"far{i % 2}",
        id=f"d-{i}",
        sender=f"s{i % 3}@near.example",
        recipients=(f"x@d{i % 4}.example",),
        timestamp=start + i,
    )


async def _durable(store: LogStore, spec: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Write a durable route's stream; return its outcome records (see the module docs)."""
    route, source = spec["route"], spec["source"]
    name = route_stream_name(route)
    stream = store.get(name) or store.create(name)
    arrived, committed = spec["committed"]
    forwarded = spec["forwarded"]
    retried, dead = set(spec.get("retried", [])), set(spec.get("dead", []))
    rows: list[tuple[Any, ...]] = []
    count, batch = spec["count"], spec["batch"]
    for low in range(0, count, batch):
        sent = [durable_message(i, spec["start"]) for i in range(low, min(low + batch, count))]
        result = await stream.append([entry_from_message(m) for m in sent])
        if not spec.get("ranges", True):
            for number, message in enumerate(sent, low):
                rows.append(
                    outcome_row(
                        KIND_ROUTE, route, source, message, arrived, Outcome.accepted(), committed
                    )
                )
                if number in dead:
                    kind, outcome, finished = KIND_DEAD_LETTER, _GONE, forwarded + 2
                else:
                    kind, outcome = KIND_FORWARD, Outcome.accepted()
                    finished = forwarded + 1 if number in retried else forwarded
                rows.append(
                    outcome_row(kind, route, "log", message, message.timestamp, outcome, finished)
                )
            continue
        [(first, taken)] = result.spans
        last = first + taken - 1
        accepted = Outcome.accepted()
        rows.append(
            range_row(KIND_ROUTE, route, source, name, first, last, arrived, accepted, committed)
        )
        exceptions = []
        for number in range(low, low + taken):
            offset = first + number - low
            if number in dead:
                exceptions.append(
                    (
                        offset,
                        KIND_DEAD_LETTER,
                        "rejected",
                        "550",
                        "gone",
                        round((forwarded + 2) * 10**6),
                        3,
                    )
                )
            elif number in retried:
                exceptions.append(
                    (
                        offset,
                        KIND_FORWARD,
                        "accepted",
                        "451",
                        "busy",
                        round((forwarded + 1) * 10**6),
                        2,
                    )
                )
        rows.append(
            range_row(
                KIND_FORWARD,
                route,
                "log",
                name,
                first,
                last,
                sent[0].timestamp,
                accepted,
                forwarded,
                exceptions,
            )
        )
    return rows


def main() -> None:
    """Entry point: directory and spec from the command line."""
    directory, spec = sys.argv[1], json.loads(sys.argv[2])
    task.react(lambda reactor: Deferred.fromCoroutine(write(reactor, directory, spec)))


if __name__ == "__main__":
    main()
