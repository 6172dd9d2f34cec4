"""What the benches share: a gateway process's configuration, figures, signals, two clients.

* `gateway_config` writes a gateway's main file from its tables; the
  ``*_TABLE`` and ``*_LISTENER`` constants are the pieces the benches share
  (loopback listeners on ports the system picks, the DMP leases the
  `bench.dmp_sink_to_feed` clients present); `add_set_option` gives a bench
  the ``--set LISTENER.KEY=VALUE`` option for the settings it adds.
* `rss_kib` and `open_fds` read a process's resident memory
  (``/proc/PID/status`` VmRSS) and open file descriptors (``/proc/PID/fd``).
* `scrape` keeps the route, error and slow-consumer figures of the gateway's
  admin ``/metrics`` (`GatewayProcess.metrics`), `metric` one sample of it.
* `stop_on_signals` makes SIGTERM and SIGHUP unwind like Ctrl-C, so that a
  bench stops its gateway (and other children) on the way out.
* `raise_open_file_limit` lifts this process's soft limit on open files to the
  hard limit: the clients of ten thousand connections need as many
  descriptors as the gateway does.
* `StreamClient` is a blocking RabbitMQ stream client on the project's client
  codec: the guest handshake with heartbeats off, then frames both ways.
* `MTLSession` is an MTL client that keeps both of its ZeroMQ sockets: the
  control REQ socket (Connection.Open, Profile, a lease) and the data DEALER
  that presented the lease.
* `log_problems` picks the lines of a gateway log that say something broke.

The other clients the benches need come from `bench.bridges`,
`bench.dmp_sink_to_feed` and `bench.mtl_flow`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import zmq

from bench.mtl_flow import U64, short
from gateway.codecs import stream as sp

if TYPE_CHECKING:
    from tests.integration.harness import GatewayProcess

__all__ = [
    "ADMIN_TABLE",
    "DMP_LISTENER",
    "GATEWAY_TABLE",
    "LOG_PROBLEM",
    "LOOPBACK_ENDPOINT",
    "MTL_LISTENER",
    "QMQP_LISTENER",
    "SSMP_LISTENER",
    "STREAM_LISTENER",
    "MTLSession",
    "StreamClient",
    "add_set_option",
    "gateway_config",
    "log_problems",
    "metric",
    "open_fds",
    "open_sockets",
    "raise_open_file_limit",
    "rss_kib",
    "scrape",
    "stop_on_signals",
    "wait_until",
]

READ_TIMEOUT_SECONDS: Final = 30.0
LOG_PROBLEM: Final = re.compile(r"Traceback|Unhandled|CRITICAL")
"""Gateway log lines that mean a bug, not a peer's mistake."""

LOOPBACK_ENDPOINT: Final = 'endpoint = "tcp:0:interface=127.0.0.1"'
"""127.0.0.1, on a port the system picks (`GatewayProcess.address` reads it back)."""
GATEWAY_TABLE: Final = ('data_dir = "data"', 'routes = "routes"')
"""Data and route files inside the gateway's scratch directory."""
ADMIN_TABLE: Final = (LOOPBACK_ENDPOINT,)
"""The admin endpoint, for ``/metrics``."""
SSMP_LISTENER: Final = ('protocol = "ssmp"', LOOPBACK_ENDPOINT, 'schemes = ["open"]')
QMQP_LISTENER: Final = ('protocol = "qmqp"', LOOPBACK_ENDPOINT)
STREAM_LISTENER: Final = ('protocol = "stream"', LOOPBACK_ENDPOINT, "guest = true")
DMP_LISTENER: Final = (
    'protocol = "dmp"',
    LOOPBACK_ENDPOINT,
    'sinks = ["in"]',
    'feeds = ["out"]',
    'leases = { writer = { sink = "in", text = "w" }, reader = { feed = "out", text = "r" } }',
)
"""Sink ``in`` and feed ``out``, leased to the texts ``w`` and ``r`` (`bench.dmp_sink_to_feed`)."""
MTL_LISTENER: Final = ('protocol = "mtl"', LOOPBACK_ENDPOINT)


def gateway_config(
    tables: Mapping[str, Sequence[str]], settings: Mapping[str, str] | None = None
) -> str:
    """A gateway's main file, with ``LISTENER.KEY`` = TOML value settings added.

    Args:
        tables: Each TOML table's name (``gateway``, ``listeners.hub``) and
            its ``key = value`` lines, in the order to write them.
        settings: ``LISTENER.KEY`` to a TOML value, added to the table
            ``listeners.LISTENER``.

    Raises:
        KeyError: A setting names a listener that ``tables`` has not.
    """
    lines = {name: list(entries) for name, entries in tables.items()}
    for dotted, value in (settings or {}).items():
        listener, _, key = dotted.partition(".")
        lines[f"listeners.{listener}"].append(f"{key} = {value}")
    return "".join(
        f"\n[{name}]\n" + "".join(f"{entry}\n" for entry in entries)
        for name, entries in lines.items()
    )


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--set LISTENER.KEY=VALUE``, repeatable: ``dict(args.set)`` is `gateway_config`'s."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        type=_listener_setting,
        metavar="LISTENER.KEY=VALUE",
        help="a listener setting (TOML value), e.g. hub.max_backlog_bytes=65536",
    )


def _listener_setting(item: str) -> tuple[str, str]:
    dotted, equals, value = item.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"expected LISTENER.KEY=VALUE, got {item!r}")
    return dotted, value


def rss_kib(pid: int) -> int:
    """The resident set size of process ``pid`` in KiB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def open_sockets(pid: int) -> int:
    """How many of process ``pid``'s open descriptors are sockets."""
    count = 0
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(entry).startswith("socket:")
    return count


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit; return the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def wait_until(condition: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes; whether it held.

    For what only ``/proc`` shows (a process's descriptor count), which has no
    event to wait on.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)
    return True


def scrape(gateway: GatewayProcess) -> dict[str, float]:
    """The gateway's route, error and slow-consumer figures from its admin ``/metrics``."""
    text = gateway.metrics(timeout=5)
    wanted = ("msggateway_route_", "msggateway_protocol_errors", "msggateway_slow_consumer")
    figures = {}
    for line in text.splitlines():
        if line.startswith(wanted) and "_bucket" not in line and "_created" not in line:
            name, _, value = line.rpartition(" ")
            figures[name] = float(value)
    return figures


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a metric family, whatever the order of its labels (0 when absent)."""
    for line in text.splitlines():
        head, _, rest = line.partition("{")
        if head != name:
            continue
        inside, _, value = rest.rpartition("} ")
        found = dict(re.findall(r'(\w+)="([^"]*)"', inside))
        if found == labels:
            return float(value)
    return 0.0


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit(128 + N) as Ctrl-C raises KeyboardInterrupt.

    The bench unwinds through its ``finally`` blocks and context managers, so
    the gateway and any other child is stopped, not left running.
    """
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)


def log_problems(output: str, limit: int = 10) -> list[str]:
    """The first ``limit`` lines of a gateway log that match `LOG_PROBLEM`."""
    found = [line.strip() for line in output.splitlines() if LOG_PROBLEM.search(line)]
    return found[:limit]


class StreamClient:
    """A blocking RabbitMQ stream client on our client codec.

    Args:
        address: The stream listener's ``(host, port)``.
        timeout: Seconds any single read may wait.
    """

    def __init__(self, address: tuple[str, int], timeout: float = READ_TIMEOUT_SECONDS) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self.events: list[Any] = []

    def send(self, *events: Any) -> None:
        """Send frames, in one write."""
        self.sock.sendall(b"".join(self.codec.send(event) for event in events))

    def receive(self) -> list[Any]:
        """Frames left over from `read`, then those one read (waiting up to the time-out) completes.

        Raises:
            EOFError: The server closed the connection.
        """
        data = self.sock.recv(1 << 20)
        if not data:
            raise EOFError("the stream listener closed the connection")
        taken = [*self.events, *self.codec.receive_data(data)]
        self.events = []
        return taken

    def read(self) -> Any:
        """The next frame from the server."""
        while not self.events:
            self.events = self.receive()
        return self.events.pop(0)

    def expect(self, kind: type[Any]) -> Any:
        """The next frame, which must be a ``kind``."""
        event = self.read()
        if not isinstance(event, kind):
            raise RuntimeError(f"expected {kind.__name__}, got {event!r}")
        return event

    def open(self) -> StreamClient:
        """Peer properties, SASL PLAIN as guest, Tune with heartbeats off, Open."""
        self.send(sp.PeerProperties(correlation_id=1, properties={"product": "msggateway-bench"}))
        self.expect(sp.PeerPropertiesResponse)
        self.send(sp.SaslHandshake(correlation_id=2))
        self.expect(sp.SaslHandshakeResponse)
        self.send(sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0guest\0guest"))
        answer = self.expect(sp.SaslAuthenticateResponse)
        if answer.code != 1:
            raise RuntimeError(f"SASL PLAIN as guest answered {answer.code}")
        tune = self.expect(sp.Tune)
        self.send(
            sp.Tune(frame_max=tune.frame_max, heartbeat=0),
            sp.Open(correlation_id=4, virtual_host="/"),
        )
        opened = self.expect(sp.OpenResponse)
        if opened.code != 1:
            raise RuntimeError(f"Open answered {opened.code}")
        return self

    def create(self, stream: str, correlation_id: int = 5) -> None:
        """Create ``stream`` (one that exists already is fine)."""
        self.send(sp.Create(correlation_id=correlation_id, stream=stream))
        answer = self.expect(sp.Response)
        if answer.code not in (1, 5):  # OK, stream already exists
            raise RuntimeError(f"Create {stream} answered {answer.code}")

    def declare_publisher(self, publisher_id: int, stream: str, correlation_id: int = 6) -> None:
        """Declare a publisher without a reference (no deduplication)."""
        self.send(
            sp.DeclarePublisher(
                correlation_id=correlation_id,
                publisher_id=publisher_id,
                reference="",
                stream=stream,
            )
        )
        answer = self.expect(sp.Response)
        if answer.code != 1:
            raise RuntimeError(f"DeclarePublisher answered {answer.code}")

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


class MTLSession:
    """An MTL client session that keeps its control REQ socket and its data DEALER.

    Args:
        context: The ZeroMQ context to make both sockets in.
        port: The MTL listener's control port.
        profile: ``test`` or ``gateway``.
        kind: ``Reader`` or ``Writer`` (the lease asked for).
        resources: The lease's resources.
        confirm: ``none`` or ``full``.
        timeout_ms: How long each reply may take.

    Raises:
        RuntimeError: A request was refused or not answered in time.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        port: int,
        profile: str = "test",
        kind: str = "Writer",
        resources: tuple[str, ...] = (),
        confirm: str = "none",
        timeout_ms: int = int(READ_TIMEOUT_SECONDS * 1000),
    ) -> None:
        self._timeout_ms = timeout_ms
        self.control: zmq.Socket[bytes] = context.socket(zmq.REQ)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.connect(f"tcp://127.0.0.1:{port}")
        self.data: zmq.Socket[bytes] | None = None
        reply: dict[str, Any] = {}
        for command, body in (
            ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
            ("Connection.Profile", {"profile": profile}),
            (f"Connection.{kind}", {"resources": list(resources), "confirm": confirm}),
        ):
            self.control.send_multipart([command.encode(), json.dumps(body).encode()])
            status, raw = self._recv(self.control)
            reply = json.loads(raw)
            if not status.startswith(b"2"):
                raise RuntimeError(f"{command} answered {status!r} {reply}")
        self.data = context.socket(zmq.DEALER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.RCVHWM, 0)
        self.data.connect(f"tcp://127.0.0.1:{reply['port']}")
        self.data.send_multipart([b"\x01" + U64.pack(1) + short(str(reply["lease"])), b""])
        self.expect_response(1)

    def _recv(self, sock: zmq.Socket[bytes]) -> list[bytes]:
        if not sock.poll(self._timeout_ms):
            raise RuntimeError("the MTL listener did not answer in time")
        return sock.recv_multipart()

    def next_command(self) -> tuple[int, bytes, bytes]:
        """The next data command (Pings answered with Pong and skipped): type, fields, body."""
        assert self.data is not None
        while True:
            header, body = self._recv(self.data)
            if header[0] == 0x08:
                self.data.send_multipart([b"\x09", b""])
                continue
            return header[0], header[1:], body

    def expect_response(self, sequence: int) -> None:
        """Wait for the Response to ``sequence``; it must be 200."""
        kind, fields, body = self.next_command()
        if kind != 0x02 or fields[:8] != U64.pack(sequence) or body != b"200":
            raise RuntimeError(f"expected 200 to {sequence}, got {kind:#x} {fields!r} {body!r}")

    def summon(self, resource_name: str, sequence: int = 2) -> None:
        """Summon a resource and wait for 200."""
        assert self.data is not None
        self.data.send_multipart([b"\x03" + U64.pack(sequence) + short(resource_name), b""])
        self.expect_response(sequence)

    def close(self) -> None:
        """Close both sockets at once (no linger)."""
        self.control.close(linger=0)
        if self.data is not None:
            self.data.close(linger=0)
