"""The rows of ``bench.burst`` with a stuck consumer: one that never reads.

Each runs its producers on a fresh gateway (`measured`) while `watch_cut`
waits for the gateway to cut the consumer, and returns the `Row`: how long
that took, what the producers were told, their longest wait, and the RSS.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Final

import zmq

from bench.burst_clients import DMPWriter, MTLReader, MTLWriter, Producer
from bench.burst_rows import (
    TOPIC,
    Row,
    Settings,
    Skipped,
    SSMPLoad,
    disconnects,
    fill_producers,
    join_all,
    measured,
    outcomes,
    split,
    ssmpload_args,
)
from bench.dmp_sink_to_feed import envelope, opened
from bench.slow_consumers import ssmp_login
from tests.integration.harness import GatewayProcess

__all__ = ["stuck_dmp", "stuck_mtl", "stuck_ssmp", "watch_cut"]

TCP_ESTABLISHED: Final = 1
"""``tcpi_state`` of an established connection (linux/tcp_states.h)."""


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of a connection (without reading it)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def watch_cut(
    row: Row,
    gateway: GatewayProcess,
    endpoint: str,
    sock: socket.socket | None,
    producing: Callable[[], bool],
    deadline: float,
) -> None:
    """Put the seconds until the gateway cut the stuck consumer in ``row.cut_after``.

    It stays None when that did not happen before ``deadline``; ``row.watched``
    says how long it was watched. Cut means: counted in the listener's
    slow-consumer disconnects (or MTL dead peers), or the connection no longer
    ESTABLISHED. Watches until the producers are done and the consumer was
    cut, or the deadline.
    """
    began = time.monotonic()
    base = disconnects(gateway, endpoint)
    cut_at = None
    scrape_at = 0.0
    while time.monotonic() < deadline:
        now = time.monotonic()
        if cut_at is None and sock is not None and tcp_state(sock) != TCP_ESTABLISHED:
            cut_at = now
        if cut_at is None and now >= scrape_at:
            scrape_at = now + 0.25
            with contextlib.suppress(OSError):
                if disconnects(gateway, endpoint) > base:
                    cut_at = time.monotonic()
        if cut_at is not None and not producing():
            break
        time.sleep(0.05)
    row.watched = time.monotonic() - began
    row.cut_after = None if cut_at is None else cut_at - began


def stuck_ssmp(settings: Settings, pubs: int) -> Row:
    """The ssmpload publishers on a topic whose only subscriber never reads."""
    row = Row("SSMP hub", f"{pubs}->1", "stuck")
    if settings.ssmpload is None:
        raise Skipped("no ssmpload (install Go, or pass --ssmpload)")
    with measured(row, settings) as gateway:
        stuck = ssmp_login(gateway, "stuck", (TOPIC,))
        args = ssmpload_args(pubs, 0, settings.stuck_messages, settings.stuck_seconds)
        load = SSMPLoad(settings, gateway, args)
        deadline = time.monotonic() + settings.stuck_seconds + 10
        watch_cut(row, gateway, "hub", stuck, load.thread.is_alive, deadline)
        load.thread.join(max(0.0, deadline + 60 - time.monotonic()))
        stuck.close()
    if load.failure:
        raise Skipped(load.failure)
    result = load.figures
    row.sent, row.acked, row.refused = (
        int(result["sent"]), int(result["acked"]), int(result["errs"])
    )  # fmt: skip
    row.rate = result["ack_rate"]
    row.told = f"200 x{row.acked:,}" + (f", errors x{row.refused:,}" if row.refused else "")
    unanswered = row.sent - row.acked - row.refused
    if unanswered:
        row.told += f", no answer x{unanswered:,}"
    row.notes.append(f"acks over {result['ack_s']:.1f} s, sending over {result['send_s']:.1f} s")
    return row


def stuck_dmp(settings: Settings, writers: int) -> Row:
    """DMP writers into the sink whose feed's reader never reads."""
    row = Row("DMP sink -> feed", f"{writers}->1", "stuck")
    one = envelope(b"x" * settings.size)
    with measured(row, settings) as gateway:
        address = gateway.address("dmp")
        stuck = opened(address, b"r")
        deadline = time.monotonic() + settings.stuck_seconds
        producers: list[Producer] = [
            DMPWriter(address, n, one, deadline) for n in split(settings.stuck_messages, writers)
        ]
        watch_cut(row, gateway, "dmp", stuck, lambda: any(p.alive for p in producers), deadline)
        join_all([p.thread for p in producers], deadline + 1)
        counted = outcomes(gateway, "dmp-loop")
        stuck.close()
    fill_producers(row, producers, settings.stuck_seconds, arrived=0.0)
    row.told = "nothing (DMP); route: " + ", ".join(f"{k} {v:,}" for k, v in counted.items() if v)
    return row


def stuck_mtl(settings: Settings, writers: int) -> Row:
    """confirm=full MTL writers routed to a reader that never reads."""
    row = Row("MTL gateway profile", f"{writers}->1", "stuck")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with measured(row, settings) as gateway:
            stuck = MTLReader(context, gateway.address("mtl2")[1], "gateway", "out", reads=False)
            deadline = time.monotonic() + settings.stuck_seconds
            port = gateway.address("mtl")[1]
            producers: list[Producer] = [
                MTLWriter(context, port, "gateway", ["in"], True, n, settings.size, deadline)
                for n in split(settings.stuck_messages, writers)
            ]
            watch_cut(row, gateway, "mtl2", None, lambda: any(p.alive for p in producers), deadline)
            join_all([p.thread for p in producers], deadline + 1)
            stuck.sock.close(linger=0)
    finally:
        context.destroy(linger=0)
    fill_producers(row, producers, settings.stuck_seconds)
    row.acked = sum(p.acked for p in producers)
    refused = ", ".join(n for n in row.notes if n.startswith("refused: "))
    row.told = f"Confirm x{row.acked:,}" + (f"; {refused}" if refused else "")
    return row
