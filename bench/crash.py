"""Kill -9 the gateway at random moments; count what it acknowledged, independently.

``python -m bench.crash`` runs each scenario ``--runs`` times (10 by
default). A run starts a gateway (``twistd msggateway``) on a fresh log,
loads it, kills it with SIGKILL at a moment drawn at random, restarts it on
the same data, lets its durable route drain, and reads every destination
stream back with rstream (a reader we did not write). It counts:

* **lost**: acknowledged to the sender (QMQP ``K``, a PublishConfirm) and
  not in the destination after the restart;
* **duplicates**: stored more than once in the destination.

Scenarios:

``qmqp-local``
    100k QMQP messages (1 KB) on one connection into a durable route whose
    destination is a stream of the gateway's own stream listener.
``qmqp-rabbitmq``
    The same into a stream on a real RabbitMQ node (Debian's package,
    `tests.rabbitmq.RabbitMQNode`) through the stream upstream.
``rstream-dedup``
    rstream publishes 100k messages into a gateway stream with a publisher
    name and explicit publishing ids; after the restart it publishes all
    of them again with the same ids, as a producer that does not know what
    was stored would.

Kill moments rotate over the runs:

``mid-stream``
    when a random share (5-95 %) of the messages has been acknowledged,
    the forwarder delivering behind the commits;
``caught-up``
    after every message was acknowledged and has reached the destination
    (the forwarder at the tail, its last offsets perhaps not yet stored);
``lagging`` (RabbitMQ only)
    the broker is stopped at a random moment (once the stream exists in
    it, with a graceful stop: RabbitMQ 3.10 does not bring back a stream
    whose creation a kill interrupted), the gateway goes on
    acknowledging into its log, and is killed with the forwarder behind by
    everything since; the broker comes back before the gateway does.

Draining is event-driven: after the restart one more message (a sentinel)
is sent through the same route, and the reader reads until it sees it; the
forwarder delivers in log order, so everything before it has been
delivered (again, where the kill left it undone) by then.

A run's table row says what the kill hit; the command exits 1 if any run
lost or duplicated an acknowledged message. ``--quick`` is a small version;
`tests/integration/test_crash.py` runs one run of each scenario in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import random
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, stream_connection

SCENARIOS: Final = ("qmqp-local", "qmqp-rabbitmq", "rstream-dedup")
KILLS: Final = {
    "qmqp-local": ("mid-stream", "caught-up"),
    "qmqp-rabbitmq": ("mid-stream", "lagging", "caught-up"),
    "rstream-dedup": ("mid-stream", "caught-up"),
}
BODY_BYTES: Final = 1000
CHUNK: Final = 500
"""QMQP blocks per socket write."""
READ_SECONDS: Final = 120.0
"""The most a run waits for its destination to show what it must."""
SUBJECT: Final = re.compile(rb"Subject: (\S+)")

CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
UPSTREAM: Final = """
[upstreams.rabbit]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
create_streams = true
"""


def routes(scenario: str, stream: str) -> dict[str, str]:
    """The durable route of a scenario (none for rstream-dedup: it publishes straight in)."""
    if scenario == "qmqp-local":
        return {
            "crash": f'from = "mail"\nmatch = "#"\nto = "streams"\naddress = "{stream}"\n'
            "durable = true\n"
        }
    if scenario == "qmqp-rabbitmq":
        return {
            "crash": f'from = "mail"\nmatch = "#"\nto = "rabbit"\naddress = "{stream}"\n'
            "durable = true\n"
        }
    return {}


@dataclass
class Run:
    """What one run did and found."""

    scenario: str
    kill: str
    sent: int = 0
    acknowledged: int = 0
    killed_at: int = 0
    """Acknowledged when the kill came."""
    stored: int = 0
    lost: int = 0
    duplicates: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing twice, nothing else wrong."""
        return not (self.lost or self.duplicates or self.problems)


# --- QMQP load ------------------------------------------------------------------------------


def token(run: int, number: int) -> bytes:
    """A message's id, also its subject: what the reader counts."""
    return b"r%03d-%07d" % (run, number)


def blocks(run: int, first: int, count: int) -> bytes:
    """``count`` message blocks of about 1 KB, numbered from ``first``."""
    out = []
    for number in range(first, first + count):
        name = token(run, number)
        out.append(
            qmqp.encode(
                qmqp.MessageBlock(
                    id=name,
                    message=b"From: crash@example.org\nSubject: "
                    + name
                    + b"\n\n"
                    + b"x" * BODY_BYTES
                    + b"\n",
                    sender=b"crash@example.org",
                    recipients=(b"ops@example.org",),
                )
            )
        )
    return b"".join(out)


class QMQPLoad:
    """Streams ``count`` messages on one connection; collects the ids answered K.

    A thread writes; `acknowledged` grows as replies are decoded (`read`).
    """

    def __init__(self, address: tuple[str, int], run: int, count: int) -> None:
        self.sock = socket.create_connection(address, timeout=READ_SECONDS)
        self.run = run
        self.count = count
        self.acknowledged: list[bytes] = []
        self.other: collections.Counter[bytes] = collections.Counter()
        self.codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.writer.start()

    def _write(self) -> None:
        with contextlib.suppress(OSError):  # the gateway is killed meanwhile
            for first in range(0, self.count, CHUNK):
                self.sock.sendall(blocks(self.run, first, min(CHUNK, self.count - first)))
            self.sock.sendall(qmqp.DONE_BYTES)

    def read(self, until: Callable[[int], bool]) -> bool:
        """Read replies until ``until(acknowledged)`` holds or the connection ends."""
        while not until(len(self.acknowledged)):
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return False
            if not data:
                return False
            for reply in self.codec.receive_data(data):
                if isinstance(reply, qmqp.ReplyBlock):
                    if reply.status == qmqp.K:
                        self.acknowledged.append(reply.id)
                    else:
                        self.other[reply.status] += 1
        return True

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()


def send_one(process: GatewayProcess, name: bytes) -> bytes:
    """Send one message over QMQP and return its reply status."""
    with socket.create_connection(process.address("mail"), timeout=READ_SECONDS) as sock:
        message = qmqp.encode(
            qmqp.MessageBlock(
                id=name,
                message=b"From: crash@example.org\nSubject: " + name + b"\n\nsentinel\n",
                sender=b"crash@example.org",
                recipients=(b"ops@example.org",),
            )
        )
        sock.sendall(message + qmqp.DONE_BYTES)
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        while True:
            data = sock.recv(1 << 16)
            if not data:
                raise EOFError("the gateway closed before answering the sentinel")
            for reply in codec.receive_data(data):
                if isinstance(reply, qmqp.ReplyBlock):
                    return bytes(reply.status)


# --- reading back ---------------------------------------------------------------------------


async def _read_tokens(connection: dict[str, Any], stream: str, until: bytes) -> list[bytes]:
    """Every message's token in ``stream`` from its first offset, until ``until`` came."""
    import rstream
    from rstream.exceptions import ServerError

    got: list[bytes] = []
    done = asyncio.Event()

    async def on_message(message: Any, context: Any) -> None:
        body = bytes(message.body if hasattr(message, "body") else message)
        found = SUBJECT.search(body)
        name = found.group(1) if found else body
        got.append(name)
        if name == until:
            done.set()

    deadline = time.monotonic() + READ_SECONDS
    while True:
        consumer = rstream.Consumer(**connection)
        await consumer.start()
        try:
            await consumer.subscribe(stream, on_message, decoder=rstream.amqp_decoder)
            break
        except ServerError as exc:
            # A broker just restarted has the stream back only once its
            # members have started; the route may not have created it yet.
            await consumer.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {stream} never became readable: {exc!r}") from exc
            await asyncio.sleep(0.2)
    runner = asyncio.create_task(consumer.run())
    try:
        await asyncio.wait_for(done.wait(), READ_SECONDS)
    finally:
        await consumer.close()
        runner.cancel()
    return got


def read_tokens(connection: dict[str, Any], stream: str, until: bytes) -> list[bytes]:
    """`_read_tokens`, from a blocking caller."""
    return asyncio.run(_read_tokens(connection, stream, until))


def count(run: Run, acknowledged: list[bytes], stored: list[bytes], extra: set[bytes]) -> None:
    """Fill in stored, lost and duplicates (``extra``: the sentinel and such)."""
    seen = collections.Counter(stored)
    run.stored = sum(n for name, n in seen.items() if name not in extra)
    run.lost = sum(1 for name in acknowledged if name not in seen)
    run.duplicates = sum(n - 1 for n in seen.values() if n > 1)


# --- the scenarios --------------------------------------------------------------------------


def qmqp_run(
    directory: Path,
    number: int,
    scenario: str,
    kill: str,
    messages: int,
    rng: random.Random,
    rabbitmq: Any | None,
) -> Run:
    """One run of qmqp-local or qmqp-rabbitmq."""
    run = Run(scenario, kill, sent=messages)
    stream = f"crash-{number}"
    config = CONFIG + (UPSTREAM.format(port=rabbitmq.stream_port) if rabbitmq else "")
    gateway = GatewayProcess(directory, config, routes=routes(scenario, stream)).start()
    reader = (
        (lambda: rabbitmq.stream_connection()) if rabbitmq else (lambda: stream_connection(gateway))
    )
    load = QMQPLoad(gateway.address("mail"), number, messages)
    try:
        if kill == "mid-stream":
            target = int(messages * rng.uniform(0.05, 0.95))
            load.read(lambda acked: acked >= target)
        elif kill == "lagging":
            assert rabbitmq is not None
            target = int(messages * rng.uniform(0.05, 0.5))
            load.read(lambda acked: acked >= target)
            # The stream is in RabbitMQ before its node goes: RabbitMQ 3.10
            # cannot bring back a stream whose creation a stop interrupted
            # ("Error while creating stream, nodedown"), which is not ours.
            read_tokens(reader(), stream, token(number, 0))
            rabbitmq.stop_broker(graceful=True)
            later = target + int(messages * rng.uniform(0.1, 0.4))
            load.read(lambda acked: acked >= later)
        else:  # caught-up
            load.read(lambda acked: acked >= messages)
            last = token(number, messages - 1)
            read_tokens(reader(), stream, last)
        run.killed_at = len(load.acknowledged)
        gateway.kill()
        load.read(lambda acked: False)  # replies already on their way, until the close
        load.close()
        run.acknowledged = len(load.acknowledged)
        if load.other:
            run.problems.append(f"replies other than K: {dict(load.other)}")
        if kill == "lagging":
            assert rabbitmq is not None
            rabbitmq.start()
        gateway = GatewayProcess(directory, config, routes=routes(scenario, stream)).start()
        sentinel = b"sentinel-%03d" % number
        status = send_one(gateway, sentinel)
        if status != qmqp.K:
            run.problems.append(f"the sentinel was answered {status!r}")
        stored = read_tokens(reader(), stream, sentinel)
        count(run, load.acknowledged, stored, {sentinel})
        if "Traceback" in gateway.output():
            run.problems.append("a traceback in the gateway's log")
    finally:
        gateway.stop()
    return run


async def _publish(
    connection: dict[str, Any],
    stream: str,
    messages: int,
    on_confirmed: Callable[[int], None],
    stop: Callable[[], bool],
) -> None:
    """Publish messages 1..N with a publisher name and their numbers as publishing ids."""
    import rstream

    async with rstream.Producer(**connection) as producer:
        await producer.create_stream(stream, exists_ok=True)

        def confirmed(status: Any) -> None:
            if status.is_confirmed:
                on_confirmed(status.message_id)

        for first in range(1, messages + 1, 1000):
            batch = []
            for number in range(first, min(first + 1000, messages + 1)):
                message = rstream.AMQPMessage(body=b"Subject: p%07d" % number)
                message.publishing_id = number  # its constructor does not take it
                batch.append(message)
            await producer.send_batch(
                stream, batch, publisher_name="crash-producer", on_publish_confirm=confirmed
            )
            await asyncio.sleep(0)
            if stop():
                return
        while not stop():
            await asyncio.sleep(0.01)


def rstream_run(directory: Path, number: int, kill: str, messages: int, rng: random.Random) -> Run:
    """One run of rstream-dedup."""
    run = Run("rstream-dedup", kill, sent=messages)
    stream = f"dedup-{number}"
    gateway = GatewayProcess(directory, CONFIG, routes={}).start()
    confirmed: set[int] = set()
    target = int(messages * rng.uniform(0.05, 0.95)) if kill == "mid-stream" else messages
    killed = threading.Event()

    def on_confirmed(publishing_id: int) -> None:
        confirmed.add(publishing_id)
        if len(confirmed) >= target and not killed.is_set():
            run.killed_at = len(confirmed)
            gateway.kill()
            killed.set()

    try:
        with contextlib.suppress(Exception):  # the connection dies with the gateway
            asyncio.run(
                asyncio.wait_for(
                    _publish(
                        stream_connection(gateway), stream, messages, on_confirmed, killed.is_set
                    ),
                    READ_SECONDS,
                )
            )
        if not killed.is_set():
            run.problems.append(f"never killed: {len(confirmed)} confirmed")
            gateway.kill()
        acknowledged = sorted(confirmed)
        run.acknowledged = len(acknowledged)
        gateway = GatewayProcess(directory, CONFIG, routes={}).start()
        again: set[int] = set()
        everything = threading.Event()

        def on_again(publishing_id: int) -> None:
            again.add(publishing_id)
            if len(again) >= messages:
                everything.set()

        asyncio.run(
            asyncio.wait_for(
                _publish(stream_connection(gateway), stream, messages, on_again, everything.is_set),
                READ_SECONDS,
            )
        )
        stored = read_tokens(stream_connection(gateway), stream, b"p%07d" % messages)
        # Everything was published again: all of it must be there, once.
        count(run, [b"p%07d" % n for n in range(1, messages + 1)], stored, set())
        if "Traceback" in gateway.output():
            run.problems.append("a traceback in the gateway's log")
    finally:
        gateway.stop()
    return run


# --- the table ------------------------------------------------------------------------------


def table(runs: list[Run]) -> list[str]:
    """One row per scenario and kill moment, totals over its runs."""
    lines = [
        "| scenario | kill | runs | messages | acknowledged | acked at kill (min-max) "
        "| lost | duplicates | problems |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.scenario, run.kill), []).append(run)
    for (scenario, kill), group in groups.items():
        at = [run.killed_at for run in group]
        problems = sum(len(run.problems) for run in group)
        lines.append(
            f"| {scenario} | {kill} | {len(group)} | {sum(r.sent for r in group):,} "
            f"| {sum(r.acknowledged for r in group):,} | {min(at):,}-{max(at):,} "
            f"| {sum(r.lost for r in group)} | {sum(r.duplicates for r in group)} | {problems} |"
        )
    return lines


def rabbitmq_node(needed: bool) -> contextlib.AbstractContextManager[Any]:
    """A private RabbitMQ node, when a scenario needs one."""
    if not needed:
        return contextlib.nullcontext()
    from tests.rabbitmq import RabbitMQNode, install_rabbitmq

    install_rabbitmq()
    return RabbitMQNode()


def runs(scenarios: list[str], count_: int, messages: int, seed: int, root: Path) -> Iterator[Run]:
    """Every run, in order (each on its own data directory)."""
    rng = random.Random(seed)
    with rabbitmq_node("qmqp-rabbitmq" in scenarios) as rabbitmq:
        for scenario in scenarios:
            kills = KILLS[scenario]
            for number in range(count_):
                kill = kills[number % len(kills)]
                directory = root / f"{scenario}-{number}"
                started = time.monotonic()
                if scenario == "rstream-dedup":
                    run = rstream_run(directory, number, kill, messages, rng)
                else:
                    run = qmqp_run(
                        directory,
                        number,
                        scenario,
                        kill,
                        messages,
                        rng,
                        rabbitmq if scenario == "qmqp-rabbitmq" else None,
                    )
                run.seconds = time.monotonic() - started
                yield run


def main() -> int:
    """Run the scenarios, print the table; 1 if anything was lost or duplicated."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per scenario (default 10)")
    parser.add_argument("--messages", type=int, default=100_000, help="messages per run")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="default: all")
    parser.add_argument("--seed", type=int, default=None, help="for the kill moments")
    parser.add_argument("--quick", action="store_true", help="2 runs of 5,000 messages")
    args = parser.parse_args()
    logging.getLogger("rstream").setLevel(logging.ERROR)  # its own reconnect chatter
    if args.quick:
        args.runs, args.messages = 2, 5000
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    scenarios = args.scenario or list(SCENARIOS)
    print(f"bench.crash: {args.runs} runs x {args.messages:,} messages, seed {seed}", flush=True)
    done: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="msggw-crash-") as root:
        for run in runs(scenarios, args.runs, args.messages, seed, Path(root)):
            done.append(run)
            print(
                f"  {run.scenario} {run.kill}: acked {run.acknowledged:,} (killed at "
                f"{run.killed_at:,}), stored {run.stored:,}, lost {run.lost}, "
                f"duplicates {run.duplicates}, {run.seconds:.1f} s"
                + (f"; {'; '.join(run.problems)}" if run.problems else ""),
                flush=True,
            )
    print()
    print("\n".join(table(done)))
    return 0 if all(run.ok for run in done) else 1


if __name__ == "__main__":
    sys.exit(main())
