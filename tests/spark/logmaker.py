"""Write a log with the gateway's own LogStore, in a child process (the tests' data).

``python -m tests.spark.logmaker DIRECTORY SPEC`` where SPEC is JSON:
``{"segment_bytes": N, "streams": {"name": {"count": N, "batch": N,
"publisher": "ref" | null, "start": T}}, "outcomes": [[route, source, status,
arrived, finished, sender, [recipients], bytes], ...]}``. Message ``i`` of
stream ``s`` has id ``s-i``, body ``body s i`` padded to 100 bytes, sender
``sender{i % 3}@example.org``, recipients ``r{i % 2}@domain{i % 4}.example``,
header ``n = i`` and timestamp ``start + i``. Appends of ``batch`` messages
are awaited one after another, so each is one chunk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred

from gateway.core.log import LogStore, Retention
from gateway.core.message import Message, Outcome, Status
from gateway.core.outcomes import KIND_ROUTE, OUTCOME_STREAM, encode_records, outcome_row
from gateway.protocols.stream.mapping import entry_from_message


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
    records = spec.get("outcomes", [])
    if records:
        stream = store.get(OUTCOME_STREAM) or store.create(OUTCOME_STREAM)
        entries = []
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
        # Entries of up to 7 records: several per entry, several entries.
        await stream.append(
            [encode_records(entries[at : at + 7]) for at in range(0, len(entries), 7)]
        )
    await store.close()


def main() -> None:
    """Entry point: directory and spec from the command line."""
    directory, spec = sys.argv[1], json.loads(sys.argv[2])
    task.react(lambda reactor: Deferred.fromCoroutine(write(reactor, directory, spec)))


if __name__ == "__main__":
    main()
