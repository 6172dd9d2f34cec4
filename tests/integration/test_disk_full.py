"""A gateway whose log's file system fills up, end to end (issue 18).

The gateway's data directory is on a small tmpfs the test mounts (root
only; skipped, with the reason, where that is not possible). A filler file
leaves a few KiB; durable QMQP mail is answered K until the disk is full,
then Z with a reason that says so; a stream publisher's Publish is
answered with a PublishError; a direct route (QMQP to the SSMP hub) and the
hub itself keep working; SSMP into a durable route is answered 400 retry.
Once the filler is deleted, writing resumes by itself: new mail is
answered K and new stream messages are confirmed, without a restart. After
a restart every acknowledged message is in the log, every chunk of every
segment passes its CRC, recovery had nothing to repair, and what SSMP put
in its durable route reached the local stream behind it exactly once (its
forwarder's appends failed, and the stream's creation, while the disk was
full).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from gateway.codecs import osiris, qmqp
from gateway.core.log.directory import directory_name
from gateway.core.log.files import PREALLOCATE_BYTES
from gateway.core.log.recovery import read_index
from gateway.protocols.stream.mapping import message_from_entry
from tests.integration.harness import (
    GatewayProcess,
    LineClient,
    read_stream_until,
    stream_connection,
)
from tests.integration.test_qmqp import QMQPSession, mail

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

DISK_BYTES: Final = 8 * 1024 * 1024
"""The tmpfs: room for the gateway's streams at start, and a filler."""
HEADROOM_BYTES: Final = 16 * 1024
"""What the filler leaves: some messages fit, then the disk is full."""
MAX_MAIL: Final = 2000
"""Durable messages sent at most while filling (the route stores each subject in
a chunk of its own, about 150 bytes)."""
MAX_TRIES: Final = 8
"""Tries after the filler is gone (the stream's waits are 0.5 s doubling to 5 s)."""
DURABLE_STREAM: Final = "msggateway.route.durable"
STREAM: Final = "events"

CONFIG: Final = """
[gateway]
data_dir = "{data}"
routes = "routes"

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
ROUTES: Final = {
    "durable": 'from = "mail"\nmatch = "#@durable.example"\nto = "hub"\n'
    'address = "mail.durable"\nbody = "subject"\ndurable = true\n',
    "direct": 'from = "mail"\nmatch = "#@direct.example"\nto = "hub"\n'
    'address = "mail.direct"\nbody = "subject"\n',
    "kept": 'from = "hub"\nmatch = "keep.#"\nto = "streams"\naddress = "kept"\ndurable = true\n',
}
KEPT_STREAM: Final = "msggateway.route.kept"
MAX_MCAST: Final = 50
"""SSMP messages sent at most while full (each of about 900 bytes: the route's
stream is new, so its last page of tmpfs has room for a few)."""


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs mounted under the test's directory, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Write a filler file until the disk is full, then give back ``leave`` bytes."""
    filler = disk / "filler"
    block = b"\0" * (64 * 1024)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = 0
        while True:
            try:
                size += os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        os.ftruncate(fd, max(0, size - leave))
    finally:
        os.close(fd)
    return filler


def send_one(session: QMQPSession, ident: str, recipient: str) -> qmqp.ReplyBlock:
    """Send one message (its subject is ``ident``) and return its reply."""
    session.send(mail(ident, recipient, subject=ident, size=2000))
    [reply] = session.read_blocks(1)
    assert isinstance(reply, qmqp.ReplyBlock), reply
    return reply


async def publish(process: GatewayProcess, body: bytes) -> int:
    """Publish one message to `STREAM` and wait for its answer: 0 if confirmed, else the code.

    Through a confirmation callback: rstream's ``send_wait`` never ends on
    a PublishError.
    """
    async with rstream.Producer(**stream_connection(process)) as producer:
        await producer.create_stream(STREAM, exists_ok=True)
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def confirmed(status: Any) -> None:
            if not answer.done():
                answer.set_result(0 if status.is_confirmed else int(status.response_code))

        await producer.send(STREAM, rstream.AMQPMessage(body=body), on_publish_confirm=confirmed)
        return await answer


async def read(process: GatewayProcess, stream: str, count: int) -> list[bytes]:
    """The bodies of the first ``count`` messages of a stream, read with rstream."""
    got: list[bytes] = []

    def take(message: Any, _context: Any) -> bool:
        got.append(bytes(message.body))
        return len(got) >= count

    # Created first: the forwarder may be later.
    await read_stream_until(stream_connection(process), stream, take, create=True)
    return got[:count]


def run(coroutine: Any, seconds: float = 20) -> Any:
    """Run a coroutine with a time limit."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))


def bodies(data: Path, stream: str) -> list[bytes]:
    """The bodies of a stream's messages, read from its files (`stream_entries`)."""
    return [
        message_from_entry(entry, stream=stream, timestamp=0.0).body
        for entry in stream_entries(data, stream)
    ]


def stream_entries(data: Path, stream: str) -> list[bytes]:
    """Every entry of a stream's committed chunks, read from its files.

    Each segment is checked as it is read: its index is exact, each chunk
    passes its CRC and starts where the one before ended, chunk ids follow
    on, and nothing lies after the last chunk.
    """
    directory = data / "log" / directory_name(stream)
    entries: list[bytes] = []
    expected: int | None = None
    for path in sorted(directory.glob("*.segment")):
        content = path.read_bytes()
        records, exact = read_index(path.with_suffix(".index"))
        assert exact, f"{path.with_suffix('.index')} is not exact"
        position = osiris.FILE_HEADER_BYTES
        for record in records:
            assert record.position == position, path
            header = osiris.validate_chunk(content, position)
            assert header.first_offset == record.chunk_id
            assert expected is None or header.first_offset == expected
            expected = header.next_offset
            if header.chunk_type == osiris.USER:
                payload = osiris.delivery_payload(content, position)
                entries.extend(map(bytes, osiris.iter_entries(payload[osiris.HEADER_BYTES :])))
            position += header.size
        assert position == len(content), f"{path}: {len(content) - position} bytes after its end"
    return entries


def resumed(process: GatewayProcess, stream: str, attempt: Any) -> Any:
    """Call ``attempt`` until it succeeds (not None), waiting out the stream's refusals.

    Each failed try is followed by a wait for the stream's next "accepts
    appends again" line: no sleeps, and at most `MAX_TRIES` tries.
    """
    line = f"Stream {stream} accepts appends again"
    for _ in range(MAX_TRIES):
        seen = process.output().count(line)
        result = attempt()
        if result is not None:
            return result
        process.wait_for_log_count(line, seen + 1, timeout=10)
    raise AssertionError(f"{stream}: still refused after {MAX_TRIES} tries:\n{process.output()}")


def test_full_disk_refuses_then_resumes_without_a_restart(tmp_path: Path, disk: Path) -> None:
    """Z and PublishError while full, direct routes unaffected, writing resumes, nothing lost."""
    data = disk / "data"
    gateway = GatewayProcess(tmp_path / "gw", CONFIG.format(data=data), routes=ROUTES).start()
    accepted: list[str] = []
    try:
        assert run(publish(gateway, b"before")) == 0
        watcher = LineClient(gateway.address("hub"))
        watcher.send("LOGIN watcher open", "SUBSCRIBE mail.direct")
        watcher.expect("200")
        watcher.expect("200")
        filler = fill(disk, HEADROOM_BYTES)
        session = QMQPSession(gateway.address("mail"))
        # Durable mail is answered K while it fits, then Z.
        for number in range(MAX_MAIL):
            ident = f"full-{number}"
            reply = send_one(session, ident, "ops@durable.example")
            if reply.status != qmqp.K:
                break
            accepted.append(ident)
        else:
            pytest.fail(f"{MAX_MAIL} messages fit on a full disk")
        assert reply.status == qmqp.Z
        assert reply.description.decode() == (
            "route durable: the log could not store the message: its file system is full;"
            " writing resumes by itself once there is room"
        )
        gateway.wait_for_log(
            rf"Writing stream {DURABLE_STREAM} failed: the file system is full \(ENOSPC\)"
            rf" at {data}/log/.*\.segment: free space .*; appends are refused for"
        )
        # SSMP into a durable route: 200 while it fits (a page's slack), then 400 retry.
        kept: list[bytes] = []
        with LineClient(gateway.address("hub")) as sender:
            sender.send("LOGIN keeper open")
            sender.expect("200")
            for number in range(MAX_MCAST):
                payload = b"%d-" % number + b"k" * 900
                sender.send(b"MCAST keep.x " + payload)
                response = sender.read_line()
                if response != b"200":
                    break
                kept.append(payload)
            else:
                pytest.fail(f"{MAX_MCAST} SSMP messages fit on a full disk")
        assert response == (
            b"400 retry: route kept: the log could not store the message: its file system"
            b" is full; writing resumes by itself once there is room"
        )
        # A stream publisher is refused (PublishError, internal error), once the
        # zeros its segment had written ahead (`PREALLOCATE_BYTES`) are taken;
        # each message is larger than what a last page of tmpfs may have left.
        confirmed: list[bytes] = []
        for number in range(PREALLOCATE_BYTES // 80_000 + 2):
            body = b"%02d while full" % number + b"." * 80_000
            code = run(publish(gateway, body))
            if code:
                break
            confirmed.append(body)
        else:
            pytest.fail(f"{len(confirmed)} stream messages of 80 KB fit on a full disk")
        assert code == 15
        # Routes that do not touch the log keep working: QMQP to the hub, and the hub.
        assert send_one(session, "direct-1", "ops@direct.example").status == qmqp.K
        watcher.expect("000 app@example.org MCAST mail.direct direct-1")
        with LineClient(gateway.address("hub")) as sender:
            sender.send("LOGIN sender open", "MCAST mail.direct hello")
            sender.expect("200")
            sender.expect("200")
        watcher.expect("000 sender MCAST mail.direct hello")
        # Space comes back: writing resumes without a restart.
        filler.unlink()

        def durable_again() -> str | None:
            ident = f"again-{len(accepted)}"
            reply = send_one(session, ident, "ops@durable.example")
            if reply.status == qmqp.Z:
                return None
            assert reply.status == qmqp.K, reply
            return ident

        accepted.append(resumed(gateway, DURABLE_STREAM, durable_again))
        assert send_one(session, "after", "ops@durable.example").status == qmqp.K
        accepted.append("after")

        def stream_again() -> bool | None:
            return True if run(publish(gateway, b"after")) == 0 else None

        resumed(gateway, STREAM, stream_again)
        gateway.wait_for_log(rf"Writing stream {DURABLE_STREAM} resumed")
        session.close()
        watcher.close()
    finally:
        gateway.stop()
    # No traceback: the log warned once per failed write, in words.
    entries = re.split(r"\n(?=\d{4}-\d\d-\d\dT)", gateway.output())
    assert [e for e in entries if "Traceback" in e] == []
    # Every message answered K or confirmed is in the log, and every chunk is whole.
    assert bodies(data, DURABLE_STREAM) == [ident.encode() for ident in accepted]
    assert bodies(data, STREAM) == [b"before", *confirmed, b"after"]
    assert bodies(data, KEPT_STREAM) == kept
    for name in ("msggateway.outcomes", STREAM, DURABLE_STREAM, KEPT_STREAM):
        stream_entries(data, name)
    restarted = GatewayProcess(tmp_path / "gw", CONFIG.format(data=data), routes=ROUTES).start()
    try:
        output = restarted.output()
        assert "Truncating" not in output and "Rebuilt index" not in output, output
        assert run(read(restarted, "kept", len(kept))) == kept
        with contextlib.closing(QMQPSession(restarted.address("mail"))) as session:
            assert send_one(session, "restarted", "ops@durable.example").status == qmqp.K
    finally:
        restarted.stop()
    assert bodies(data, "kept") == kept  # once each
