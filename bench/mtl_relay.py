"""How far the MTL routed bench can go on this machine: the gateway against a bare relay.

bench/bridges.py's ``mtl-routed`` row compares the gateway's routed path (a
confirm=full writer's Contents, through a route, to a confirm=full reader on
another listener; the reader's Confirms turned into Confirms to the writer)
with the gateway's own test profile (a writer's Contents fanned out to a
reader, nothing confirmed). Gateway and Python client share two cores, so
the routed path, with twice the ZeroMQ messages per Content, could be
limited by the client or by ZeroMQ rather than by the gateway's own work.

This bench tells which. ``--serve`` runs a bare relay: raw pyzmq, one
thread, two listeners, only what the routed bench sends (the control flow's
Open, Profile, Reader and Writer; Lease, Summon, Content, Confirm and Ping),
reading and sending as the gateway does (bursts, frame objects, the
compiled send), with no routes, messages, outcomes, lease checks,
back-pressure or metrics: the routed path with nothing else in it. The
measurement runs bench/bridges.py's routed flood against the relay and
against the gateway (``twistd msggateway``), and its test-profile flood
against the gateway, each on a fresh server, in turns, and prints each
against the gateway's test profile of the same round, with each server's
CPU per message.

Run: ``python bench/mtl_relay.py [--rounds N] [--seconds S]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bridges, stream_vs_rabbitmq  # noqa: E402
from gateway.protocols.mtl.zmq import DEFAULT_HIGH_WATER_MARK  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

CONTENT, CONFIRM, PING, PONG, LEASE, RESPONSE, SUMMON = 0x05, 0x06, 0x08, 0x09, 0x01, 0x02, 0x03
OK = b"200"
HEAD = struct.Struct(">BQ")
CONFIRM_MULTIPLE = struct.Struct(">BQB")
BURST = 1000


class Relay:
    """Two MTL listeners (control and data ROUTERs each) relaying writers' Contents to readers."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.controls = [self._router() for _ in range(2)]
        self.datas = [self._router() for _ in range(2)]
        self.control_ports = [self._bind(s) for s in self.controls]
        self.data_ports = [self._bind(s) for s in self.datas]
        self.leases: dict[str, tuple[str, str, str]] = {}  # lease: profile, kind, confirm
        self.peers: dict[tuple[int, bytes], tuple[str, str, str]] = {}
        self.readers: dict[str, tuple[int, bytes]] = {}  # profile: the reader's socket, id
        self.sequence = itertools.count(1)
        self.unconfirmed: dict[int, tuple[int, bytes, int]] = {}  # ours: writer socket, id, its
        self.lease_numbers = itertools.count(1)

    def _router(self) -> zmq.Socket[bytes]:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.SNDHWM, DEFAULT_HIGH_WATER_MARK)
        socket.setsockopt(zmq.RCVHWM, DEFAULT_HIGH_WATER_MARK)
        return socket

    @staticmethod
    def _bind(socket: zmq.Socket[bytes]) -> int:
        return socket.bind_to_random_port("tcp://127.0.0.1")

    def control(self, listener: int, frames: list[bytes]) -> None:
        """A control request: [identity, empty, command, body]; answer 200 (202 with a lease)."""
        identity, _, command, _body = frames[:4]
        reply: dict[str, Any] = {}
        body = json.loads(frames[3]) if len(frames) > 3 else {}
        name = command.decode()
        if name in ("Connection.Reader", "Connection.Writer"):
            lease = f"L{next(self.lease_numbers)}"
            profile = self.leases.get(f"profile-{identity.hex()}", ("gateway",))[0]
            self.leases[lease] = (profile, name.split(".")[1], body.get("confirm", "none"))
            reply = {"port": self.data_ports[listener], "lease": lease}
        elif name == "Connection.Profile":
            self.leases[f"profile-{identity.hex()}"] = (body["profile"], "", "")
        self.controls[listener].send_multipart([identity, b"", b"200", json.dumps(reply).encode()])

    def serve(self) -> None:
        """Relay until killed."""
        poller = zmq.Poller()
        for socket in (*self.controls, *self.datas):
            poller.register(socket, zmq.POLLIN)
        recv = [s.recv for s in self.datas]
        sends = [zmq.backend.Socket.send.__get__(s) for s in self.datas]
        more, last = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)
        print(f"listening {self.control_ports[0]} {self.control_ports[1]}", flush=True)
        while True:
            ready = dict(poller.poll())
            for listener, socket in enumerate(self.controls):
                if socket in ready:
                    self.control(listener, socket.recv_multipart())
            for listener, socket in enumerate(self.datas):
                if socket in ready:
                    self.burst(listener, recv[listener], sends, more, last)

    def burst(self, listener: int, recv: Callable[..., Any], sends: list[Callable[..., Any]],
              more: int, last: int) -> None:  # fmt: skip
        """Read what waits on one data socket (up to a burst), relay it, confirm writers once."""
        out: list[tuple[int, list[bytes]]] = []
        confirmed: dict[tuple[int, bytes], int] = {}
        for _ in range(BURST):
            try:
                identity = recv(last)
            except zmq.Again:
                break
            # As the gateway reads: the identity as bytes, then frame objects.
            frame = recv(last, copy=False)
            frames = [identity, frame.bytes]
            while frame.more:
                frame = recv(last, copy=False)
                frames.append(frame.bytes)
            header = frames[1]
            kind = header[0]
            if kind == CONFIRM:
                entry = self.unconfirmed.pop(HEAD.unpack_from(header)[1], None)
                if entry is not None:
                    confirmed[entry[0], entry[1]] = entry[2]
            elif kind == CONTENT:
                self.content(listener, identity, header, frames[2], out)
            elif kind == LEASE:
                profile, kind_name, confirm = self.leases[header[10:].decode()]
                self.peers[listener, identity] = (profile, kind_name, confirm)
                out.append((listener, [identity, bytes((RESPONSE,)) + header[1:9], OK]))
            elif kind == SUMMON:
                profile = self.peers[listener, identity][0]
                self.readers[profile] = (listener, identity)
                out.append((listener, [identity, bytes((RESPONSE,)) + header[1:9], OK]))
            elif kind == PING:
                out.append((listener, [identity, bytes((PONG,)), b""]))
        for (writer_listener, writer), sequence in confirmed.items():
            header = CONFIRM_MULTIPLE.pack(CONFIRM, sequence, 1)
            out.append((writer_listener, [writer, header, b""]))
        for target, message in out:
            send = sends[target]
            send(message[0], more)
            send(message[1], more)
            send(message[2], last)

    def content(self, listener: int, identity: bytes, header: bytes, body: bytes,
                out: list[tuple[int, list[bytes]]]) -> None:  # fmt: skip
        """A writer's Content to the reader of its profile (confirm=full: remember whose)."""
        profile, _kind, confirm = self.peers[listener, identity]
        reader = self.readers.get(profile)
        if reader is None:
            return
        ours = next(self.sequence)
        if confirm == "full":
            self.unconfirmed[ours] = (listener, identity, HEAD.unpack_from(header)[1])
        # The writer's resource and table go out as they came (the benches send "" and none).
        out.append((reader[0], [reader[1], HEAD.pack(CONTENT, ours) + header[9:], body]))


@contextmanager
def relay_server() -> Iterator[tuple[int, int, int]]:
    """The relay in its own process; yields (first port, second port, pid)."""
    command = [sys.executable, __file__, "--serve"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        _, first, second = process.stdout.readline().split()
        yield int(first), int(second), process.pid
    finally:
        process.terminate()
        process.wait(10)


@contextmanager
def gateway_server(routed: bool) -> Iterator[tuple[int, int, int]]:
    """A fresh gateway with bench/bridges.py's two MTL listeners; yields (port, port2, pid)."""
    with tempfile.TemporaryDirectory() as scratch:
        routes = {"across": bridges.MTL_ROUTE} if routed else None
        process = GatewayProcess(Path(scratch), bridges.MTL, routes=routes).start()
        try:
            yield process.address("mtl")[1], process.address("mtl2")[1], process.pid
        finally:
            process.stop()


def measure(server: Any, routed: bool, seconds: float) -> tuple[float, float]:
    """One flood on a fresh server: messages a second and the server's CPU µs a message."""
    with server as (port, port2, pid):
        before = stream_vs_rabbitmq._cpu_seconds(pid)
        if routed:
            result = bridges.mtl_routed_flood(port, port2, seconds, 10**8)
        else:
            result = bridges.mtl_test_flood(port, seconds, 10**8)
        after = stream_vs_rabbitmq._cpu_seconds(pid)
    if result["problems"]:
        raise SystemExit(f"{'routed' if routed else 'test'} flood: {result['problems']}")
    count = result["messages"]["rate"]
    rate = result["rates"]["rate"]
    return rate, ((after - before) / count * 1e6 if before is not None and after else 0.0)


def main() -> None:
    """Measure the three paths in turns and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", help="run the relay (internal)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if args.serve:
        Relay().serve()
        return
    paths = [("relay", True), ("gateway", True), ("gateway", False)]
    figures: dict[tuple[str, bool], list[tuple[float, float]]] = {path: [] for path in paths}
    for round_number in range(args.rounds):
        for name, routed in paths if round_number % 2 == 0 else paths[::-1]:
            server = relay_server() if name == "relay" else gateway_server(routed)
            figures[name, routed].append(measure(server, routed, args.seconds))
            print(f"round {round_number + 1}: {name} {routed=} done", file=sys.stderr)
    tests = [rate for rate, _cpu in figures["gateway", False]]
    print(f"{'path':24} {'msg/s':>8} {'vs test profile':>16} {'(min-max)':>12} {'us/msg':>7}")
    for (name, routed), rows in figures.items():
        ratios = [rate / test for (rate, _cpu), test in zip(rows, tests, strict=True)]
        label = f"{name} {'routed' if routed else 'test profile'}"
        print(
            f"{label:24} {statistics.median(rate for rate, _cpu in rows):>8,.0f}"
            f" {statistics.median(ratios):>15.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}x"
            f" {statistics.median(cpu for _rate, cpu in rows):>7.1f}"
        )
    print(
        f"medians of {args.rounds} rounds of {args.seconds:g} s; vs test profile: against the"
        " gateway's test profile in the same round; us/msg: the server process's CPU per message"
    )


if __name__ == "__main__":
    main()
