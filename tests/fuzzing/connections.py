"""Malformed connections against a running gateway, and the checks that it survived them.

One gateway (`GATEWAY_CONFIG`) listens for SSMP, QMQP, the stream protocol,
DMP and MTL. `payloads` makes what a malformed client of each TCP protocol
sends: random bytes, a valid session cut short (a half frame), a length far
over every limit, a valid handshake followed by mutated frames, or a
mutated session from `tests.fuzzing.targets` (bad handshakes come from
mutations of the first bytes). `flood` opens one connection per payload,
some at a time from a pool of threads, sends it in one to three writes and
ends the connection in one of three ways: closing at once, half-closing and
reading until the gateway closes, or a reset.

MTL runs over ZeroMQ: `mtl_flood` opens DEALER sockets on the control and
data ports, sends malformed multipart messages (frame counts, headers and
JSON bodies, deep nestings included), then a request whose answer it can
recognise, and counts the sockets that got that answer; a quarter of its
connections are raw TCP garbage to those ports instead, which libzmq's
ZMTP handshake must refuse.

`serves` makes one valid exchange per protocol; `rss_kib` reads the
process's resident memory; `TRACEBACK_MARKERS` are what must never appear
in the gateway's log.
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import zmq

from gateway.codecs import dmp, fieldtable, qmqp
from gateway.codecs import stream as sp
from tests.codec_checks import split_at
from tests.fuzzing import nesting
from tests.fuzzing.mutation import mutate_bytes
from tests.fuzzing.samples import DMP_LEASE, Input
from tests.fuzzing.targets import draw_pool, fuzz_input, target

__all__ = [
    "GATEWAY_CONFIG",
    "HANDSHAKE_ANSWERED",
    "PROTOCOLS",
    "TCP_PROTOCOLS",
    "TRACEBACK_MARKERS",
    "FloodResult",
    "Payload",
    "alive",
    "flood",
    "mtl_flood",
    "payload_pools",
    "payloads",
    "rss_kib",
    "serves",
]

_QUICK_REFUSALS: Final = """
login_failure_delay_seconds = 0.001
login_failure_max_delay_seconds = 0.004
"""
GATEWAY_CONFIG: Final = f"""
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.ssmp]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
{_QUICK_REFUSALS}
[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
{_QUICK_REFUSALS}
[listeners.stream]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
frame_max = 65536
{_QUICK_REFUSALS}
[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["s"]
{_QUICK_REFUSALS}
[listeners.dmp.leases]
writer = {{ sink = "s", text = "{DMP_LEASE}" }}

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
{_QUICK_REFUSALS}"""
"""One listener per protocol on loopback, port 0; the DMP sink lease is `DMP_LEASE`.

Every flood comes from one address, and many of its logins are refused: the
refusals wait, as they do for guessers, but milliseconds rather than the
default seconds (`_QUICK_REFUSALS`), so that a half-closed connection is
answered and closed well within the clients' read time-out while the
waiting code is fuzzed too (tests/security/test_brute_force.py tests the
waits themselves)."""

TCP_PROTOCOLS: Final = ("ssmp", "qmqp", "stream", "dmp")
"""The listeners a malformed TCP client can reach directly (their names in the config)."""

PROTOCOLS: Final = (*TCP_PROTOCOLS, "mtl")

TRACEBACK_MARKERS: Final = ("Traceback", "Unhandled")
"""Log text that means an exception escaped an adapter."""

READ_TIMEOUT_SECONDS: Final = 10.0
"""How long any read of a client here waits (the gateway answers in milliseconds)."""

_TARGETS: Final = {
    "ssmp": "ssmp/server",
    "qmqp": "qmqp/server",
    "stream": "stream/server",
    "dmp": "dmp/server",
}
"""The codec target whose valid inputs (client sessions) each protocol's payloads mutate."""


# --- payloads ----------------------------------------------------------------------------------


def _stream_handshake() -> bytes:
    """A guest's whole stream handshake, pipelined: afterwards frames reach the open session."""
    return b"".join(
        sp.encode(event)
        for event in (
            sp.PeerProperties(correlation_id=1, properties={"product": "fuzz"}),
            sp.SaslHandshake(correlation_id=2),
            sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0guest\0guest"),
            sp.Tune(frame_max=65536, heartbeat=0),
            sp.Open(correlation_id=4, virtual_host="/"),
        )
    )


_HANDSHAKES: Final[dict[str, bytes]] = {
    "ssmp": b"LOGIN fuzz open\n",
    "qmqp": b"",
    "stream": _stream_handshake(),
    "dmp": dmp.PROTOCOL_HEADER + fieldtable.encode_short_string(DMP_LEASE),
}
"""What gets a client past each protocol's handshake (QMQP has none)."""

_OVERSIZED: Final[dict[str, tuple[bytes, ...]]] = {
    "ssmp": (b"MCAST t " + b"x" * 5000, b"LOGIN " + b"a" * 2000 + b" open\n"),
    "qmqp": (b"99999999999:", b"4294967296:1:M,", b"33554433:1:M,3:abc,"),
    "stream": (
        b"\xff\xff\xff\xff\x00\x02\x00\x01",
        b"\x7f\xff\xff\xff",
        b"\x00\x01\x00\x01\x00\x11",
    ),
    "dmp": (b"\xff\xff\xff\xff", b"\x04\x00\x00\x01\x00\x00", b"\x00\x00\xff\xff\x00"),
}
"""Lengths far over each protocol's limits (sent after its handshake, or instead of it)."""


def payload_pools(count: int, seed_value: int = 0) -> dict[str, list[Input]]:
    """Valid client sessions of each TCP protocol, ``count`` each, for `payloads` to mutate."""
    return {
        protocol: draw_pool(target(name), count, seed_value) for protocol, name in _TARGETS.items()
    }


Payload = tuple[bytes, bytes]
"""What one connection sends: a handshake to wait for an answer to (or nothing), then the rest."""


def payloads(protocol: str, rng: random.Random, pool: Sequence[Input], count: int) -> list[Payload]:
    """``count`` malformed things a client of ``protocol`` might send, drawn from ``rng``.

    About one in six each: random bytes; a valid session cut short; an
    oversized length after the handshake (answered first) or instead of it;
    the handshake then a mutated session; and, for the rest, a mutated
    session (which breaks the handshake when the mutation lands in it).
    """
    fuzz_target = target(_TARGETS[protocol])
    out: list[Payload] = []
    for index in range(count):
        handshake = _HANDSHAKES[protocol]
        if protocol == "ssmp":  # one identity each: a second LOGIN of one closes the first
            handshake = b"LOGIN fuzz%d open\n" % index
        kind = rng.randrange(6)
        first = b""
        if kind == 0:
            data = rng.randbytes(rng.randrange(1, 512))
        elif kind == 1:
            whole = handshake + rng.choice(pool)[0] if pool else handshake
            data = whole[: rng.randrange(1, max(2, len(whole)))]
        elif kind == 2:
            first = handshake if rng.random() < 0.7 else b""
            data = rng.choice(_OVERSIZED[protocol])
        elif kind == 3:
            first, data = handshake, fuzz_input(fuzz_target, rng, pool)[0]
        else:
            data = fuzz_input(fuzz_target, rng, pool)[0]
        out.append((first, data or b"\x00"))
    return out


def _stream_opened(data: bytes) -> bool:
    try:
        events = sp.StreamCodec(sp.Role.CLIENT, frame_max=0).receive_data(data)
    except sp.StreamError:
        return True  # nothing more will come that the client could wait for
    return any(isinstance(event, sp.OpenResponse) for event in events)


def _dmp_ready(data: bytes) -> bool:
    try:
        return len(dmp.DMPCodec(dmp.Role.CLIENT).receive_data(data)) >= 2
    except dmp.DMPError:
        return True


HANDSHAKE_ANSWERED: Final[dict[str, Callable[[bytes], bool]]] = {
    "ssmp": lambda data: b"\n" in data,
    "qmqp": lambda data: True,
    "stream": _stream_opened,
    "dmp": _dmp_ready,
    "mtl": lambda data: True,
}
"""Whether what the gateway sent so far completes its answer to the handshake."""


# --- TCP connections ---------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class FloodResult:
    """What a flood of malformed connections did.

    Attributes:
        connections: Connections opened (each sent its payload, or tried to).
        reset: Connections the gateway refused, reset or closed before it
            was sent the whole payload (it may stop reading at the first error).
        unclosed: Half-closed connections the gateway had not closed within
            the read time-out (it should close at once on a peer's end of input).
        answered: Connections on which the gateway sent something back.
    """

    connections: int = 0
    reset: int = 0
    unclosed: int = 0
    answered: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, *, reset: bool, unclosed: bool, answered: bool) -> None:
        """Count one connection."""
        with self._lock:
            self.connections += 1
            self.reset += reset
            self.unclosed += unclosed
            self.answered += answered


def _pieces(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` in one to three writes."""
    cuts = [rng.randrange(len(data) + 1) for _ in range(rng.randrange(3))]
    return [piece for piece in split_at(data, cuts) if piece]


def _one_connection(
    address: tuple[str, int],
    payload: Payload,
    answered_when: Callable[[bytes], bool],
    seed_value: int,
    result: FloodResult,
) -> None:
    """Send the payload (the handshake first, waiting for its answer) and end the connection."""
    rng = random.Random(seed_value)
    handshake, data = payload
    ending = rng.choices(("close", "half-close", "reset"), weights=(4, 5, 1))[0]
    reset = unclosed = answered = False
    try:
        sock = socket.create_connection(address, timeout=READ_TIMEOUT_SECONDS)
    except OSError:
        result.add(reset=True, unclosed=False, answered=False)
        return
    try:
        if handshake:
            sock.sendall(handshake)
            received = _read_until(sock, answered_when)
            answered = bool(received)
        for piece in _pieces(data, rng):
            sock.sendall(piece)
        if ending == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif ending == "half-close":
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                answered = True
    except TimeoutError:
        unclosed = True
    except OSError:  # reset by the gateway, which may close before reading everything
        reset = True
    finally:
        sock.close()
    result.add(reset=reset, unclosed=unclosed, answered=answered)


def flood(
    address: tuple[str, int],
    data: Iterable[Payload],
    *,
    answered_when: Callable[[bytes], bool] = lambda data: True,
    concurrency: int = 32,
    seed_value: int = 0,
    deadline: float | None = None,
) -> FloodResult:
    """Open one connection per payload, ``concurrency`` at a time; count what happened.

    Args:
        address: The listener.
        data: What each connection sends.
        answered_when: Whether the bytes received complete the answer to a
            payload's handshake (`HANDSHAKE_ANSWERED`).
        concurrency: Connections open at once (threads).
        seed_value: Seeds how each connection cuts its payload and ends.
        deadline: A `time.monotonic` time after which no new connection starts.
    """
    result = FloodResult()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for index, payload in enumerate(data):
            if deadline is not None and time.monotonic() > deadline:
                break
            seed_of = seed_value * 1_000_003 + index
            pool.submit(_one_connection, address, payload, answered_when, seed_of, result)
    return result


# --- MTL over ZeroMQ ---------------------------------------------------------------------------

_OPEN: Final = json.dumps({"protocol": {"name": "MTL", "version": 1}}).encode()


def _control_junk(rng: random.Random, pool: Sequence[Input]) -> list[bytes]:
    """One malformed control message as a DEALER sends it (usually after the empty delimiter)."""
    choice = rng.random()
    if choice < 0.2:
        frames = [rng.choice((b"Connection.Open", b"connection.profile")), nesting.json_text(rng)]
    elif choice < 0.4:
        frames = [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(5))]
    else:
        frames = list(fuzz_input(target("mtl/control"), rng, pool))
    if rng.random() < 0.1 and frames:  # no delimiter: the identity's frame is followed by junk
        return frames
    return [b"", *frames]


def _data_junk(rng: random.Random, pool: Sequence[Input]) -> list[bytes]:
    """One malformed data command."""
    return list(fuzz_input(target("mtl/data"), rng, pool)) or [b""]


def mtl_data_port(context: zmq.Context[zmq.Socket[bytes]], control: tuple[str, int]) -> int:
    """The MTL listener's data port, from a Connection.Writer lease."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{control[0]}:{control[1]}")
    try:
        replies = []
        for command, body in (
            ("Connection.Open", _OPEN),
            ("Connection.Profile", b'{"profile": "test"}'),
            ("Connection.Writer", b'{"resources": [], "confirm": "none"}'),
        ):
            sock.send_multipart([b"", command.encode(), body])
            if not sock.poll(int(READ_TIMEOUT_SECONDS * 1000)):
                raise AssertionError(f"no answer to {command}")
            replies.append(sock.recv_multipart())
        _, status, reply = replies[-1]
        assert status == b"202", replies
        return int(json.loads(reply)["port"])
    finally:
        sock.close()


def _mtl_batch(
    context: zmq.Context[zmq.Socket[bytes]],
    control: str,
    data: str,
    rng: random.Random,
    pools: tuple[Sequence[Input], Sequence[Input]],
    size: int,
    first: int,
) -> int:
    """``size`` DEALER sockets send junk then a recognisable request; the number answered."""
    waiting: dict[zmq.Socket[bytes], bytes] = {}
    for index in range(first, first + size):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if rng.random() < 0.5:
            sock.connect(control)
            for _ in range(rng.randint(1, 4)):
                sock.send_multipart(_control_junk(rng, pools[0]))
            token = f"connection.probe-{index}".encode()
            sock.send_multipart([b"", b"Connection.Open", _OPEN])
            sock.send_multipart([b"", token, b"{}"])
        else:
            sock.connect(data)
            for _ in range(rng.randint(1, 4)):
                sock.send_multipart(_data_junk(rng, pools[1]))
            token = struct.pack(">BQ", 0x02, index)  # the Response to our Summon
            sock.send_multipart([struct.pack(">BQB", 0x03, index, 1) + b"r", b""])
        waiting[sock] = token
    answered = 0
    poller = zmq.Poller()
    for sock in waiting:
        poller.register(sock, zmq.POLLIN)
    stop = time.monotonic() + READ_TIMEOUT_SECONDS
    while waiting and time.monotonic() < stop:
        for sock, _ in poller.poll(int((stop - time.monotonic()) * 1000) + 1):
            if sock not in waiting:
                continue
            frames = sock.recv_multipart()
            if any(waiting[sock] in frame for frame in frames):
                answered += 1
                del waiting[sock]
                poller.unregister(sock)
                sock.close()
    for sock in waiting:
        sock.close()
    return answered


def mtl_flood(
    address: tuple[str, int],
    count: int,
    *,
    rng: random.Random,
    concurrency: int = 32,
    deadline: float | None = None,
) -> FloodResult:
    """``count`` malformed MTL connections: three in four ZeroMQ peers, one in four raw TCP.

    A ZeroMQ peer counts as answered when its recognisable request (an
    unknown control command carrying its number, or a Summon with its
    number as the sequence) was answered after its junk; a raw TCP
    connection sends garbage or a mutated ZMTP greeting to the control or
    the data port.
    """
    pools = (draw_pool(target("mtl/control"), 200), draw_pool(target("mtl/data"), 200))
    result = FloodResult()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        data_port = mtl_data_port(context, address)
        control = f"tcp://{address[0]}:{address[1]}"
        data = f"tcp://{address[0]}:{data_port}"
        raw_count = count // 4
        greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16) + b"\x00" + bytes(31)
        ready = b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
        raw = (
            (b"", rng.randbytes(rng.randrange(1, 200)))
            if rng.random() < 0.5
            else (b"", mutate_bytes(rng, greeting + ready))
            for _ in range(raw_count)
        )
        raw_result = flood(
            address,
            raw,
            concurrency=concurrency,
            seed_value=rng.randrange(2**32),
            deadline=deadline,
        )
        result.connections += raw_result.connections
        result.reset += raw_result.reset
        result.unclosed += raw_result.unclosed
        made = 0
        while made < count - raw_count:
            if deadline is not None and time.monotonic() > deadline:
                break
            size = min(concurrency, count - raw_count - made)
            answered = _mtl_batch(context, control, data, rng, pools, size, made)
            result.connections += size
            result.answered += answered
            result.unclosed += size - answered
            made += size
    finally:
        context.destroy(linger=0)
    return result


# --- still serving? ------------------------------------------------------------------------------


def _read_until(sock: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    data = b""
    while not done(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _serves_ssmp(address: tuple[str, int]) -> bool:
    with socket.create_connection(address, timeout=READ_TIMEOUT_SECONDS) as sock:
        sock.sendall(b"LOGIN probe open\nPING\n")
        return _read_until(sock, lambda data: data.count(b"\n") >= 2) == b"200\n000 . PONG\n"


def _serves_qmqp(address: tuple[str, int]) -> bool:
    block = qmqp.MessageBlock(id=b"probe", message=b"x", sender=b"a@b", recipients=(b"c@d",))
    with socket.create_connection(address, timeout=READ_TIMEOUT_SECONDS) as sock:
        sock.sendall(qmqp.encode(block) + qmqp.encode(qmqp.DONE))
        answer = _read_until(sock, lambda data: False)
    blocks = qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(answer)
    return [type(item) for item in blocks] == [qmqp.ReplyBlock, qmqp.DoneBlock]


def _serves_stream(address: tuple[str, int]) -> bool:
    codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
    events: list[object] = []
    with socket.create_connection(address, timeout=READ_TIMEOUT_SECONDS) as sock:
        sock.sendall(_stream_handshake() + sp.encode(sp.Metadata(correlation_id=9, streams=("x",))))
        while not any(isinstance(event, sp.MetadataResponse) for event in events):
            chunk = sock.recv(65536)
            if not chunk:
                return False
            events.extend(codec.receive_data(chunk))
    return any(isinstance(event, sp.OpenResponse) and event.code == 1 for event in events)


def _serves_dmp(address: tuple[str, int]) -> bool:
    with socket.create_connection(address, timeout=READ_TIMEOUT_SECONDS) as sock:
        sock.sendall(_HANDSHAKES["dmp"])
        codec = dmp.DMPCodec(dmp.Role.CLIENT)
        events: list[object] = []
        while len(events) < 2:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            events.extend(codec.receive_data(chunk))
    return all(isinstance(event, dmp.Response) and event.ok for event in events)


def _serves_mtl(address: tuple[str, int]) -> bool:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        data_port = mtl_data_port(context, address)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address[0]}:{data_port}")
        sock.send_multipart([struct.pack(">BQB", 0x03, 77, 1) + b"r", b""])
        deadline = time.monotonic() + READ_TIMEOUT_SECONDS
        while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            header, *_ = sock.recv_multipart()
            if header == struct.pack(">BQ", 0x02, 77):
                return True
        return False
    finally:
        context.destroy(linger=0)


_PROBES: Final[dict[str, Callable[[tuple[str, int]], bool]]] = {
    "ssmp": _serves_ssmp,
    "qmqp": _serves_qmqp,
    "stream": _serves_stream,
    "dmp": _serves_dmp,
    "mtl": _serves_mtl,
}


def serves(protocol: str, address: tuple[str, int]) -> bool:
    """Whether a valid exchange of ``protocol`` succeeds at ``address``.

    SSMP: LOGIN and PING answered; QMQP: a message answered and the done
    block returned; stream: the guest handshake opens and Metadata is
    answered; DMP: the header and the lease accepted; MTL: a writer lease
    granted on the control port and a Summon answered on the data port.
    """
    try:
        return _PROBES[protocol](address)
    except (OSError, AssertionError, ValueError):
        return False


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def rss_kib(pid: int) -> int:
    """The resident memory of process ``pid``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")
