"""The rows of ``bench.burst`` with healthy (and slowed) consumers, one function a path.

Each runs its producers against its consumer on a fresh gateway (`measured`)
and returns the `Row`: sent, acknowledged, delivered, lost (acknowledged and
never delivered, or sent and never delivered where the protocol answers
nothing), the producers' rate and longest wait, and notes.
"""

from __future__ import annotations

import time

import zmq

from bench.burst_clients import (
    BATCH,
    DeliverTally,
    DMPWriter,
    EnvelopeTally,
    LineTally,
    MTLReader,
    MTLWriter,
    Producer,
    QMQPSender,
    SocketReader,
    StreamPublisher,
)
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
    ssmpload,
    ssmpload_args,
)
from bench.dmp_sink_to_feed import envelope, opened
from bench.gateway_proc import StreamClient
from bench.qmqp_stream import block
from bench.slow_consumers import ssmp_login
from gateway.codecs import stream as sp

__all__ = ["dmp_row", "hub_row", "mtl_row", "qmqp_row", "stream_row"]


# --- SSMP through ssmpload -----------------------------------------------------------------


def hub_row(settings: Settings, pubs: int, subs: int, window: int = 0) -> Row:
    """Publishers to subscribers on one topic, both ssmpload's."""
    shape = f"{pubs}->{subs}" + (f" -window {window}" if window else "")
    row = Row("SSMP hub", shape)
    with measured(row, settings) as gateway:
        args = ssmpload_args(pubs, subs, settings.messages, settings.seconds)
        figures = ssmpload(settings, gateway, [*args, "-window", str(window)])
        cut = disconnects(gateway, "hub")
    acked, delivered = int(figures["acked"]), int(figures["delivered"])
    row.sent, row.acked, row.delivered = int(figures["sent"]), acked, delivered
    row.lost = max(0, acked * subs - delivered)
    row.rate, row.delivery_rate = figures["ack_rate"], figures["deliv_rate"]
    row.refused = int(figures["errs"])
    row.notes.append(
        f"{delivered:,} of {acked * subs:,} deliveries, {figures['deliv_rate']:,.0f}/s"
    )
    if row.refused:
        row.notes.append(f"{row.refused:,} answered other than 200")
    unanswered = row.sent - acked - row.refused
    if unanswered:
        row.notes.append(f"{unanswered:,} unanswered")
    if figures["ooo"] or figures["dups"]:
        row.notes.append(f"out of order {figures['ooo']:.0f}, duplicates {figures['dups']:.0f}")
    if cut:
        row.notes.append(f"{cut} subscriber(s) cut as slow")
    return row


# --- QMQP -> SSMP --------------------------------------------------------------------------


def qmqp_row(settings: Settings, senders: int, ssmp_pubs: int = 0) -> Row:
    """QMQP senders through the route to the hub, one Python subscriber counting.

    With ``ssmp_pubs``, ssmpload publishers share the topic meanwhile (no
    subscribers of their own); their 200s count as acknowledged too.
    """
    shape = f"{senders}->1" + (f" +{ssmp_pubs} SSMP pubs" if ssmp_pubs else "")
    row = Row("QMQP -> SSMP", shape)
    blocks = [block(i, settings.size) for i in range(BATCH)]
    with measured(row, settings) as gateway:
        subscriber = ssmp_login(gateway, "reader", (TOPIC,))
        tally = LineTally(subscriber)
        reader = SocketReader(subscriber, tally)
        deadline = time.monotonic() + settings.seconds
        side_load = None
        if ssmp_pubs:
            args = ssmpload_args(ssmp_pubs, 0, settings.messages, settings.seconds)
            side_load = SSMPLoad(settings, gateway, args)
        producers: list[Producer] = [
            QMQPSender(gateway.address("mail"), count, blocks, deadline)
            for count in split(settings.messages, senders)
        ]
        threads = [p.thread for p in producers] + ([side_load.thread] if side_load else [])
        join_all(threads, deadline + 5)
        side = side_load.figures if side_load else {}
        side_acked = int(side.get("acked", 0))

        def expected() -> int:
            return sum(p.acked for p in producers) + side_acked

        reader.drain(expected, lambda: any(t.is_alive() for t in threads), deadline + 10)
    fill_producers(row, producers, settings.seconds)
    acked = sum(p.acked for p in producers)
    row.acked = acked + side_acked
    row.delivered = reader.messages
    row.lost = max(0, row.acked - reader.messages)
    from_qmqp = reader.messages - tally.from_ssmpload
    row.notes.append(f"K x{acked:,}, delivered from QMQP {from_qmqp:,}")
    if ssmp_pubs:
        if not side:
            row.notes.append("ssmpload failed")
        else:
            row.sent = (row.sent or 0) + int(side["sent"])
            row.notes.append(
                f"SSMP 200 x{side_acked:,} of {side['sent']:,.0f} sent, "
                f"delivered {tally.from_ssmpload:,}"
            )
    row.notes.extend(reader.notes())
    return row


# --- DMP sink -> feed ----------------------------------------------------------------------


def dmp_row(settings: Settings, writers: int, slowed: bool = False) -> Row:
    """DMP writers into the sink, routed to the feed, one reader."""
    row = Row("DMP sink -> feed", f"{writers}->1", "slowed, 4 KiB a ms" if slowed else "healthy")
    one = envelope(b"x" * settings.size)
    with measured(row, settings) as gateway:
        address = gateway.address("dmp")
        reader = SocketReader(opened(address, b"r"), EnvelopeTally(), slowed=slowed)
        deadline = time.monotonic() + settings.seconds
        counts = split(settings.messages, writers)
        producers: list[Producer] = [DMPWriter(address, n, one, deadline) for n in counts]
        total = sum(counts)
        join_all([p.thread for p in producers], deadline)
        reader.drain(lambda: total, lambda: any(p.alive for p in producers), deadline + 10)
        counted = outcomes(gateway, "dmp-loop")
        cut = disconnects(gateway, "dmp")
    fill_producers(row, producers, settings.seconds, arrived=reader.last)
    row.delivered = reader.messages
    row.lost = (row.sent or 0) - reader.messages
    row.notes.append(
        "no answer in DMP; route outcomes: "
        + ", ".join(f"{k} {v:,}" for k, v in counted.items() if v)
    )
    if cut:
        row.notes.append(f"reader cut as slow x{cut}")
    row.notes.extend(reader.notes())
    return row


# --- MTL -----------------------------------------------------------------------------------


def mtl_row(settings: Settings, writers: int, profile: str) -> Row:
    """MTL writers to one reader: the test profile, or confirm=full writers through a route."""
    row = Row(f"MTL {profile} profile", f"{writers}->1")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with measured(row, settings) as gateway:
            port = gateway.address("mtl")[1]
            gateway_profile = profile == "gateway"
            if gateway_profile:
                reader = MTLReader(context, gateway.address("mtl2")[1], profile, "out")
            else:
                reader = MTLReader(context, port, profile, "resource")
            deadline = time.monotonic() + settings.seconds
            resources = ["in"] if gateway_profile else []
            producers: list[Producer] = [
                MTLWriter(
                    context, port, profile, resources, gateway_profile, n, settings.size, deadline
                )
                for n in split(settings.messages, writers)
            ]
            join_all([p.thread for p in producers], deadline + 1)

            def expected() -> int:
                return sum((p.acked if gateway_profile else p.sent) for p in producers)

            reader.drain(expected, lambda: any(p.alive for p in producers), deadline + 10)
            reader.sock.close(linger=0)
    finally:
        context.destroy(linger=0)
    arrived = None if gateway_profile else reader.last
    fill_producers(row, producers, settings.seconds, arrived=arrived)
    row.delivered = reader.messages
    if gateway_profile:
        row.acked = sum(p.acked for p in producers)
        row.lost = max(0, row.acked - reader.messages)
    else:
        row.lost = (row.sent or 0) - reader.messages
        row.notes.append("no answer in the test profile")
    return row


# --- stream --------------------------------------------------------------------------------


def stream_row(settings: Settings, publishers: int) -> Row:
    """Stream publishers with confirms, one consumer from the first offset."""
    row = Row("stream listener", f"{publishers}->1", "healthy, from first")
    with measured(row, settings) as gateway:
        address = gateway.address("streams")
        setup = StreamClient(address, timeout=10).open()
        setup.create(TOPIC)
        consumer = StreamClient(address, timeout=10).open()
        consumer.send(
            sp.Subscribe(
                correlation_id=7,
                subscription_id=1,
                stream=TOPIC,
                offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
                credit=10,
            )
        )
        answer = consumer.read()
        if not isinstance(answer, sp.Response) or answer.code != 1:
            raise Skipped(f"Subscribe answered {answer!r}")
        reader = SocketReader(consumer.sock, DeliverTally(consumer))
        deadline = time.monotonic() + settings.seconds
        producers: list[Producer] = [
            StreamPublisher(address, TOPIC, n, settings.size, deadline)
            for n in split(settings.messages, publishers)
        ]
        join_all([p.thread for p in producers], deadline + 1)
        reader.drain(
            lambda: sum(p.acked for p in producers),
            lambda: any(p.alive for p in producers),
            deadline + 10,
        )
        setup.close()
    fill_producers(row, producers, settings.seconds)
    row.acked = sum(p.acked for p in producers)
    row.delivered = reader.messages
    row.lost = max(0, row.acked - reader.messages)
    row.notes.extend(reader.notes())
    return row
