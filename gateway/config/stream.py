"""RabbitMQ Stream listener and upstream keys."""

from __future__ import annotations

from typing import Final

from gateway.config.base import (
    Section,
    TableSchema,
    boolean,
    choice,
    integer,
    optional_string,
    positive,
    string,
    strings,
)
from gateway.config.endpoints import MAX_PORT
from gateway.fleet.node import MAX_REFERENCE_PREFIX_BYTES
from gateway.protocols.stream.client import parse_offset
from gateway.protocols.stream.settings import (
    CONSUME_FROM as CONSUME_FROM_CHOICES,
)
from gateway.protocols.stream.settings import (
    DEFAULT_FRAME_MAX,
    StreamListenerSettings,
    StreamUpstreamSettings,
)

__all__ = ["LISTENER", "UPSTREAM", "read_listener", "read_upstream"]


# --- listener ------------------------------------------------------------------------

ADVERTISED_HOST: Final = optional_string(
    "advertised_host",
    doc="The host clients are told to connect to in Metadata.",
    shown="the address it listens on",
)
ADVERTISED_PORT: Final = integer(
    "advertised_port",
    0,
    doc="The port clients are told in Metadata. With [fleet] processes, worker i advertises"
    " this + i.",
    shown="the port it got (a worker's: its own port, worker_ports + i)",
)
WORKER_PORTS: Final = integer(
    "worker_ports",
    0,
    doc="With [fleet] processes, worker i also listens on this port + i, a port of its own"
    " that its Metadata and Open name, so that a client reaches the worker that owns a"
    " stream; the listener's port stays the entry point, shared by all workers."
    " check-config refuses a range that runs into another port.",
    shown="the listener's port + 1 (0 when that is 0: each worker picks a free port)",
)
GUEST: Final = boolean(
    "guest",
    False,
    doc="User guest with password guest may log in from loopback only, as on a fresh RabbitMQ.",
)
ANONYMOUS: Final = boolean("anonymous", False, doc="Offer SASL ANONYMOUS.")
VIRTUAL_HOSTS: Final = strings("virtual_hosts", ("/",), doc="The virtual hosts Open accepts.")
FRAME_MAX: Final = integer(
    "frame_max",
    DEFAULT_FRAME_MAX,
    doc="Largest frame accepted after Open, proposed in Tune (0: no limit); past it Close 14.",
)
HEARTBEAT_SECONDS: Final = integer(
    "heartbeat_seconds",
    60,
    doc="Heartbeat interval proposed in Tune (0: none); missed heartbeats abort the connection.",
)
MAX_UNCONFIRMED: Final = integer(
    "max_unconfirmed",
    50_000,
    minimum=1,
    doc="Published messages not yet confirmed, per connection, before the listener stops"
    " reading it.",
)
HANDSHAKE_TIMEOUT_SECONDS: Final = positive(
    "handshake_timeout_seconds", 10.0, doc="A connection not through Open by then is closed."
)

LISTENER: Final = TableSchema(
    "Stream listener",
    '[listeners.NAME] protocol = "stream"',
    (
        ADVERTISED_HOST,
        ADVERTISED_PORT,
        WORKER_PORTS,
        GUEST,
        ANONYMOUS,
        VIRTUAL_HOSTS,
        FRAME_MAX,
        HEARTBEAT_SECONDS,
        MAX_UNCONFIRMED,
        HANDSHAKE_TIMEOUT_SECONDS,
    ),
    doc="Serves the RabbitMQ Stream protocol over the embedded log (rstream, the Java client);"
    " SASL PLAIN against the secrets file, EXTERNAL on an mtls: listener.",
)


def read_listener(section: Section, tls: bool) -> StreamListenerSettings:
    """A stream listener's own keys."""
    port = section.read(ADVERTISED_PORT)
    worker_ports = section.read(WORKER_PORTS)
    for key, value in ((ADVERTISED_PORT, port), (WORKER_PORTS, worker_ports)):
        if value > MAX_PORT:
            section.problem(key, f"must be a TCP port, at most {MAX_PORT}, not {value}")
    return StreamListenerSettings(
        advertised_host=section.read(ADVERTISED_HOST),
        advertised_port=port or None,
        worker_ports=worker_ports,
        guest=section.read(GUEST),
        anonymous=section.read(ANONYMOUS),
        virtual_hosts=frozenset(section.read(VIRTUAL_HOSTS)),
        frame_max=section.read(FRAME_MAX),
        heartbeat_seconds=section.read(HEARTBEAT_SECONDS),
        max_unconfirmed=section.read(MAX_UNCONFIRMED),
        handshake_timeout_seconds=section.read(HANDSHAKE_TIMEOUT_SECONDS),
    )


# --- upstream ------------------------------------------------------------------------

STREAM: Final = optional_string(
    "stream",
    doc="Publish every routed message to this stream.",
    shown="the message's address",
)
PUBLISHER_REFERENCE: Final = optional_string(
    "publisher_reference",
    doc="Publisher reference for deduplication (one publisher per stream), to which the"
    f" node id is appended (REFERENCE.NODE, see [fleet]); at most {MAX_REFERENCE_PREFIX_BYTES}"
    " bytes.",
    shown="msggateway.NAME",
)
CONSUMER_NAME: Final = optional_string(
    "consumer_name", doc="Name consumed offsets are stored under.", shown="msggateway.NAME"
)
OFFSET: Final = string(
    "offset",
    "next",
    doc="Where a subscription starts the first time: first, last, next, offset:N or"
    " timestamp:MILLISECONDS; afterwards after the offset stored under consumer_name.",
)
USERNAME: Final = string(
    "username",
    "guest",
    doc="SASL PLAIN user; the password is the upstream's secret (guest needs none).",
)
VIRTUAL_HOST: Final = string("virtual_host", "/", doc="The virtual host opened after Tune.")
BATCH_SIZE: Final = integer(
    "batch_size", 1000, minimum=1, doc="Messages per Publish frame, at most (within frame_max)."
)
UPSTREAM_MAX_UNCONFIRMED: Final = integer(
    "max_unconfirmed", 20_000, minimum=1, doc="Messages published and not yet confirmed, at most."
)
MAX_QUEUE: Final = integer(
    "max_queue",
    100_000,
    minimum=1,
    doc="Messages waiting to be published, at most; past it a delivery is retry later at once.",
)
SUBSCRIBE: Final = strings("subscribe", doc="Streams consumed into the routes from this upstream.")
STORE_OFFSET_INTERVAL_SECONDS: Final = positive(
    "store_offset_interval_seconds",
    0.2,
    doc="Consumed offsets are stored as chunks settle, at most this often.",
)
CREDIT: Final = integer("credit", 10, minimum=1, doc="Chunks granted to a subscription at a time.")
CREATE_STREAMS: Final = boolean(
    "create_streams", False, doc="Create the streams it publishes to and consumes from."
)
UPSTREAM_HEARTBEAT_SECONDS: Final = integer(
    "heartbeat_seconds", 60, doc="Heartbeat proposed in Tune (0: none)."
)
UPSTREAM_FRAME_MAX: Final = integer(
    "frame_max", DEFAULT_FRAME_MAX, doc="Largest frame proposed in Tune."
)
CONSUME_FROM: Final = choice(
    "consume_from",
    CONSUME_FROM_CHOICES,
    "leader",
    doc="``leader``: subscriptions share the publishing connection; ``replica``: they read"
    " over a connection of their own to a replica that Metadata names.",
)

UPSTREAM: Final = TableSchema(
    "Stream upstream",
    '[upstreams.NAME] protocol = "stream"',
    (
        USERNAME,
        VIRTUAL_HOST,
        STREAM,
        PUBLISHER_REFERENCE,
        BATCH_SIZE,
        UPSTREAM_MAX_UNCONFIRMED,
        MAX_QUEUE,
        CREATE_STREAMS,
        SUBSCRIBE,
        OFFSET,
        CONSUMER_NAME,
        STORE_OFFSET_INTERVAL_SECONDS,
        CREDIT,
        CONSUME_FROM,
        UPSTREAM_HEARTBEAT_SECONDS,
        UPSTREAM_FRAME_MAX,
    ),
    doc="Publishes to and consumes from a RabbitMQ stream node, following the leader of each"
    " stream.",
)


def read_upstream(section: Section) -> StreamUpstreamSettings:
    """A stream upstream's own keys."""
    stream = section.read(STREAM)
    reference = section.read(PUBLISHER_REFERENCE)
    if reference is not None and len(reference.encode("utf-8")) > MAX_REFERENCE_PREFIX_BYTES:
        section.problem(
            PUBLISHER_REFERENCE,
            f"must be at most {MAX_REFERENCE_PREFIX_BYTES} UTF-8 bytes (the node id is appended"
            " within the stream protocol's 255), not"
            f" {len(reference.encode('utf-8'))}",
        )
        reference = None
    consumer = section.read(CONSUMER_NAME)
    offset = section.read(OFFSET)
    try:
        parse_offset(offset)
    except ValueError as exc:
        section.problem(OFFSET, str(exc))
        offset = OFFSET.default
    return StreamUpstreamSettings(
        username=section.read(USERNAME),
        virtual_host=section.read(VIRTUAL_HOST),
        stream=stream,
        publisher_reference=reference,
        batch_size=section.read(BATCH_SIZE),
        max_unconfirmed=section.read(UPSTREAM_MAX_UNCONFIRMED),
        max_queue=section.read(MAX_QUEUE),
        subscribe=section.read(SUBSCRIBE),
        offset=offset,
        consumer_name=consumer,
        store_offset_interval_seconds=section.read(STORE_OFFSET_INTERVAL_SECONDS),
        credit=section.read(CREDIT),
        create_streams=section.read(CREATE_STREAMS),
        heartbeat_seconds=section.read(UPSTREAM_HEARTBEAT_SECONDS),
        frame_max=section.read(UPSTREAM_FRAME_MAX),
        consume_from=section.read(CONSUME_FROM),
    )
