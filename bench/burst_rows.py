"""What every row of ``bench.burst`` shares: its figures, its gateway, its producers' sums.

* `Row` is one line of a table, `Settings` what every row is run with, and
  `Skipped` a row that could not run.
* `measured` is a fresh gateway (`TABLES`, `ROUTES`, the ``--set`` settings
  added) whose RSS is sampled for the row; `outcomes` and `disconnects` read
  its ``/metrics``.
* `split` shares a row's messages among its producers, `join_all` waits for
  them, and `fill_producers` sums their figures into the row.
* `ssmpload` runs the independent SSMP load generator against the hub, and
  `SSMPLoad` runs it on a thread beside the Python producers.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench.burst_clients import IDLE_SECONDS, Producer, started
from bench.gateway_proc import MTL_LISTENER, QMQP_LISTENER, gateway_config, log_problems, metric
from bench.slow_consumers import TABLES as SLOW_CONSUMER_TABLES
from bench.slow_consumers import RSSSampler
from bench.ssmp_hub import load_figures
from tests.integration.harness import GatewayProcess, GatewayStartError

__all__ = [
    "ROUTES",
    "TABLES",
    "TOPIC",
    "Row",
    "SSMPLoad",
    "Settings",
    "Skipped",
    "disconnects",
    "fill_producers",
    "join_all",
    "measured",
    "outcomes",
    "split",
    "ssmpload",
    "ssmpload_args",
]

TOPIC: Final = "burst"
"""The hub topic of every SSMP row (ssmpload's ``-topic``), and the stream's name."""
TABLES: Final = {
    **SLOW_CONSUMER_TABLES,
    "listeners.mtl": MTL_LISTENER,
    "listeners.mail": QMQP_LISTENER,
}
"""The gateway of `bench.slow_consumers`, its ``mtl`` listener with both profiles (the test
profile's rows), and a QMQP listener ``mail`` (`gateway_config`)."""
ROUTES: Final = {
    "mail-to-hub": f'from = "mail"\nmatch = "#"\nto = "hub"\naddress = "{TOPIC}"\n'
    'body = "subject"\n',
    "dmp-loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n',
    "mtl-across": 'from = "mtl"\nmatch = "in"\nto = "mtl2"\naddress = "out"\n',
}


@dataclass
class Row:
    """One line of a table: a scenario's figures."""

    path: str
    shape: str
    consumer: str = "healthy"
    sent: int | None = None
    acked: int | None = None
    refused: int = 0
    delivered: int | None = None
    lost: int | None = None
    rate: float | None = None
    delivery_rate: float | None = None
    rss_start: float = 0.0
    rss_peak: float = 0.0
    cut_after: float | None = None
    watched: float = 0.0
    stall: float | None = None
    told: str = "-"
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    """What every row is run with."""

    messages: int
    stuck_messages: int
    size: int
    seconds: float
    stuck_seconds: float
    ssmpload: Path | None
    listener_settings: dict[str, str]


class Skipped(Exception):  # noqa: N818 (a state, reported in the table)
    """A row that could not run; the message says why."""


@contextmanager
def measured(row: Row, settings: Settings) -> Iterator[GatewayProcess]:
    """A fresh gateway whose RSS is sampled for ``row``; its log's problems become notes."""
    with tempfile.TemporaryDirectory() as directory:
        gateway = GatewayProcess(
            Path(directory),
            gateway_config(TABLES, settings.listener_settings),
            routes=dict(ROUTES),
        )
        try:
            gateway.start()
        except GatewayStartError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise Skipped(f"the gateway did not start: {lines[0]} {lines[-1]}") from exc
        try:
            with RSSSampler(gateway.pid) as sampler:
                yield gateway
        finally:
            row.rss_start = sampler.samples[0][1]
            row.rss_peak = sampler.peak()
            row.notes.extend(f"gateway log: {line}" for line in log_problems(gateway.output(), 3))
            gateway.stop()


def outcomes(gateway: GatewayProcess, route: str) -> dict[str, int]:
    """A route's outcome counts from ``/metrics``."""
    text = gateway.metrics()
    return {
        outcome: int(metric(text, "msggateway_route_outcomes_total", route=route, outcome=outcome))
        for outcome in ("accepted", "retry", "rejected")
    }


def disconnects(gateway: GatewayProcess, endpoint: str) -> int:
    """Slow consumers the listener cut, and for MTL the data peers it forgot as dead."""
    text = gateway.metrics()
    cut = metric(text, "msggateway_slow_consumer_disconnects_total", endpoint=endpoint)
    dead = metric(text, "msggateway_protocol_errors_total", endpoint=endpoint, kind="dead-peer")
    return int(cut + dead)


# --- producers -----------------------------------------------------------------------------


def split(total: int, parts: int) -> list[int]:
    """Each of ``parts`` producers' share of ``total``."""
    return [total // parts + (number < total % parts) for number in range(parts)]


def join_all(threads: list[threading.Thread], deadline: float) -> bool:
    """Join threads until ``deadline``; whether all ended."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def fill_producers(
    row: Row, producers: list[Producer], seconds: float, arrived: float | None = None
) -> None:
    """Sent, acknowledged, refused, rate, longest wait and problems of ``producers``.

    The rate is of what was acknowledged, or, given ``arrived`` (where the
    protocol answers nothing: when the consumer got its last message), of
    what was sent until then or until the last write, whichever is later.
    """
    row.sent = sum(p.sent for p in producers)
    refused = sum((p.refused for p in producers), Counter[str]())
    row.refused = refused.total()
    if refused:
        row.notes.append("refused: " + ", ".join(f"{k} x{v:,}" for k, v in refused.items()))
    row.stall = max((p.stall for p in producers), default=0.0)
    began = min((p.began for p in producers), default=0.0)
    end = max((p.last for p in producers), default=0.0)
    if arrived is None:
        done = sum(p.acked for p in producers)
    else:
        done, end = row.sent, max(end, arrived)
    row.rate = done / (end - began) if end > began else None
    for number, producer in enumerate(producers):
        if producer.problem:
            row.notes.append(f"producer {number}: {producer.problem}")
        if producer.alive:
            row.notes.append(f"producer {number} still running after {seconds:.0f} s")


# --- SSMP through ssmpload -----------------------------------------------------------------


def ssmpload(settings: Settings, gateway: GatewayProcess, args: list[str]) -> dict[str, float]:
    """Run ssmpload (MCAST on `TOPIC`) against the gateway's hub; its RESULT figures."""
    if settings.ssmpload is None:
        raise Skipped("no ssmpload (install Go, or pass --ssmpload)")
    port = gateway.address("hub")[1]
    base = ["-mode", "mcast", "-topic", TOPIC, "-drain", f"{IDLE_SECONDS:.0f}s"]
    try:
        figures, _ = load_figures(
            settings.ssmpload, port, gateway.pid, [*base, *args], timeout=settings.seconds + 60
        )
    except subprocess.CalledProcessError as exc:
        raise Skipped(f"ssmpload exited with {exc.returncode}: {exc.stderr.strip()[:200]}") from exc
    except subprocess.TimeoutExpired as exc:
        raise Skipped("ssmpload did not finish in time") from exc
    return figures


def ssmpload_args(pubs: int, subs: int, messages: int, seconds: float) -> list[str]:
    """Publishers, subscribers, the message count and the time bound."""
    return [
        "-pubs", str(pubs), "-subs", str(subs), "-max", str(messages),
        "-duration", f"{seconds:.0f}s",
    ]  # fmt: skip


class SSMPLoad:
    """`ssmpload` on a thread: its figures once it is done (empty until then), or why it failed.

    Args:
        settings: The row's settings (the ssmpload binary, the time bound).
        gateway: Whose hub it loads.
        args: `ssmpload_args` and any more.
    """

    def __init__(self, settings: Settings, gateway: GatewayProcess, args: list[str]) -> None:
        self.figures: dict[str, float] = {}
        self.failure: str | None = None
        self._settings = settings
        self._gateway = gateway
        self._args = args
        self.thread = started(self._run)

    def _run(self) -> None:
        try:
            self.figures.update(ssmpload(self._settings, self._gateway, self._args))
        except Skipped as exc:
            self.failure = str(exc)
