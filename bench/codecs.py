"""Micro-benchmark the DMP and MTL codecs (and their mappings): nanoseconds per message.

In one process, no sockets: each operation runs over a batch of
``--batch`` messages, timed with `timeit` (``--repeat`` runs, the fastest
kept, as the others only add the machine's noise; the operations' runs
interleaved), and is reported per message. The operations are those of
the two bridges issue 15 measured:

* DMP: encoding an envelope (bare, and as a feed writes one: message id,
  timestamp, app id), a feed's batch of messages to bytes
  (`write_envelopes`: mapping and encoding), decoding a read of envelopes
  in 64 KiB pieces (bare, and with properties), and a sink's read to
  messages (decoding and `message_from_envelope`);
* MTL: encoding and decoding Content (empty properties, as the bench
  peers write it, and with a message id, as the gateway writes it),
  Confirm and Reject, and the mappings' two directions.

Operations that a version of the code does not have print ``-``. To
compare two versions, save one run with ``--json before.json`` and give
it to the other with ``--compare before.json``: both columns and their
ratio are printed. Run with ``python bench/codecs.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.codecs import dmp, mtl  # noqa: E402
from gateway.core.message import Message, Outcome  # noqa: E402
from gateway.protocols.dmp import mapping as dmp_mapping  # noqa: E402
from gateway.protocols.dmp.flow import HeldWrites, write_envelopes  # noqa: E402
from gateway.protocols.mtl import mapping as mtl_mapping  # noqa: E402

READ_BYTES = 65536
"""What one read hands the codec, at most (Twisted reads 64 KiB at a time)."""
BODY = b"x" * 100
NOW = 1_700_000_000.5
_REFUSED = Outcome.retry("not expected here: the batch is never held back")

Operation = Callable[[], object]
"""Runs the operation once over the whole batch."""


def _messages(count: int) -> list[Message]:
    return [Message(body=BODY, address="out", timestamp=NOW) for _ in range(count)]


def _feed_envelope(message: Message) -> dmp.Envelope:
    return dmp.Envelope(
        exchange="out",
        routing_key=message.address,
        properties=dmp.BasicProperties(
            message_id=message.id, timestamp=int(message.timestamp), app_id="msggateway"
        ),
        body=message.body,
    )


def _reads(wire: bytes) -> list[bytes]:
    return [wire[start : start + READ_BYTES] for start in range(0, len(wire), READ_BYTES)]


def _flowing_codec() -> dmp.DMPCodec:
    codec = dmp.DMPCodec(dmp.Role.SERVER)
    codec.receive_data(dmp.PROTOCOL_HEADER + b"\x01L")
    return codec


def _decode_reads(reads: list[bytes]) -> Operation:
    def run() -> object:
        codec = _flowing_codec()
        return [codec.receive_data(data) for data in reads]

    return run


def dmp_operations(batch: int) -> dict[str, Operation | None]:
    """The DMP operations, each over ``batch`` messages."""
    messages = _messages(batch)
    bare = [dmp.Envelope(body=BODY) for _ in range(batch)]
    fed = [_feed_envelope(message) for message in messages]
    with_properties = [
        dmp.Envelope(
            exchange="amq.direct",
            routing_key="orders",
            properties=dmp.BasicProperties(
                content_type="text/plain",
                message_id=f"m-{index}",
                timestamp=1_700_000_000,
                headers={"x-gateway-sender": "app@example.org"},
            ),
            body=BODY,
        )
        for index in range(batch)
    ]
    encode = dmp.encode_envelope
    bare_reads = _reads(b"".join(map(encode, bare)))
    property_reads = _reads(b"".join(map(encode, with_properties)))
    writes = HeldWrites(lambda data: None)

    def feed() -> object:
        return write_envelopes(
            writes, messages, "out", 1 << 30, lambda held: _REFUSED, lambda why: _REFUSED
        )

    def sink() -> object:
        codec = _flowing_codec()
        to_message = dmp_mapping.message_from_envelope
        return [
            to_message(event, "in", NOW)  # type: ignore[arg-type]
            for data in bare_reads
            for event in codec.receive_data(data)
        ]

    fields: Operation | None = None
    encode_fields = getattr(dmp, "encode_envelope_fields", None)
    if encode_fields is not None:

        def run_fields() -> object:
            return [
                encode_fields(
                    "out",
                    message.address,
                    message_id=message.id,
                    timestamp=int(message.timestamp),
                    headers=None,
                    app_id="msggateway",
                    body=message.body,
                )
                for message in messages
            ]

        fields = run_fields
    return {
        "dmp encode bare envelope": lambda: [encode(envelope) for envelope in bare],
        "dmp encode feed envelope (event)": lambda: [encode(envelope) for envelope in fed],
        "dmp encode feed envelope (fields)": fields,
        "dmp feed: messages -> bytes": feed,
        "dmp decode bare envelopes": _decode_reads(bare_reads),
        "dmp decode envelopes with properties": _decode_reads(property_reads),
        "dmp sink: bytes -> messages": sink,
    }


def mtl_operations(batch: int) -> dict[str, Operation | None]:
    """The MTL operations, each over ``batch`` messages."""
    messages = _messages(batch)
    plain = [mtl.Content(index, "", {}, BODY) for index in range(batch)]
    identified = [
        mtl.Content(index, "out", {"message-id": message.id}, BODY)
        for index, message in enumerate(messages)
    ]
    confirms = [mtl.Confirm(index, False) for index in range(batch)]
    rejects = [mtl.Reject(index, False, True) for index in range(batch)]
    encode, decode = mtl.encode_data, mtl.decode_data
    frames = {
        name: [encode(command) for command in commands]
        for name, commands in (
            ("plain", plain),
            ("identified", identified),
            ("confirm", confirms),
            ("reject", rejects),
        )
    }

    def writer_in() -> object:
        to_message = mtl_mapping.message_from_content
        out = []
        for pair in frames["plain"]:
            command = decode(pair)
            assert isinstance(command, mtl.Content)
            out.append(to_message("in", command.properties, command.body, NOW))
        return out

    def reader_out() -> object:
        properties_of = mtl_mapping.content_properties
        return [
            encode(mtl.Content(index, message.address, properties_of(message), message.body))
            for index, message in enumerate(messages)
        ]

    return {
        "mtl encode Content (no properties)": lambda: [encode(c) for c in plain],
        "mtl encode Content (message-id)": lambda: [encode(c) for c in identified],
        "mtl decode Content (no properties)": lambda: [decode(f) for f in frames["plain"]],
        "mtl decode Content (message-id)": lambda: [decode(f) for f in frames["identified"]],
        "mtl encode Confirm": lambda: [encode(c) for c in confirms],
        "mtl decode Confirm": lambda: [decode(f) for f in frames["confirm"]],
        "mtl encode Reject": lambda: [encode(c) for c in rejects],
        "mtl decode Reject": lambda: [decode(f) for f in frames["reject"]],
        "mtl writer in: frames -> messages": writer_in,
        "mtl reader out: messages -> frames": reader_out,
    }


def measure(
    operations: dict[str, Operation], batch: int, repeat: int, rounds: int
) -> dict[str, float]:
    """Nanoseconds per message of each operation's fastest run over the batch.

    The runs of all operations are interleaved in ``rounds`` (``repeat``
    runs each in all), so that a burst of other load on a shared machine
    slows a few runs of every operation rather than all runs of one.
    """
    for operation in operations.values():
        operation()  # warm up
    best = dict.fromkeys(operations, float("inf"))
    per_round = max(1, repeat // rounds)
    for _ in range(rounds):
        for name, operation in operations.items():
            fastest = min(timeit.repeat(operation, number=1, repeat=per_round))
            best[name] = min(best[name], fastest)
    return {name: seconds / batch * 1e9 for name, seconds in best.items()}


def main() -> None:
    """Measure every operation and print the table (with a saved run beside it, if given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1000, help="messages per run")
    parser.add_argument("--repeat", type=int, default=40, help="runs per operation")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds of runs")
    parser.add_argument("--json", type=Path, help="save the figures here")
    parser.add_argument("--compare", type=Path, help="figures saved by an earlier run")
    args = parser.parse_args()
    operations = {**dmp_operations(args.batch), **mtl_operations(args.batch)}
    present = {name: operation for name, operation in operations.items() if operation is not None}
    figures = measure(present, args.batch, args.repeat, args.rounds)
    before: dict[str, float] = json.loads(args.compare.read_text()) if args.compare else {}
    width = max(map(len, operations))
    if before:
        print(f"{'operation':<{width}}  {'before ns':>10}  {'after ns':>10}  {'after/before':>12}")
    else:
        print(f"{'operation':<{width}}  {'ns/message':>10}")
    for name in operations:
        now = f"{figures[name]:10,.0f}" if name in figures else f"{'-':>10}"
        if before:
            then = f"{before[name]:10,.0f}" if name in before else f"{'-':>10}"
            ratio = (
                f"{figures[name] / before[name]:12.2f}"
                if name in figures and name in before
                else f"{'-':>12}"
            )
            print(f"{name:<{width}}  {then}  {now}  {ratio}")
        else:
            print(f"{name:<{width}}  {now}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
