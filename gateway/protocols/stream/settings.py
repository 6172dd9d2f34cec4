"""Settings of stream listeners, as validated by `gateway.config`."""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["CONSUME_FROM", "DEFAULT_FRAME_MAX", "StreamListenerSettings", "StreamUpstreamSettings"]

DEFAULT_FRAME_MAX: Final = 1024 * 1024
"""RabbitMQ's default frame_max (1 MiB)."""
CONSUME_FROM: Final = frozenset({"leader", "replica"})
"""Where an upstream's subscriptions read from."""


@attrs.frozen(kw_only=True)
class StreamListenerSettings:
    """How a RabbitMQ Stream protocol listener behaves.

    Attributes:
        advertised_host: The host clients are told to connect to in Metadata
            (default: the address the listener is bound to).
        advertised_port: The port they are told (default: the port it got).
            A worker of ``[fleet] processes`` advertises this + its index.
        worker_ports: With ``[fleet] processes``, worker i also listens on
            this port + i, its own (0: the listener's port + 1; each worker
            a free port of its own when the listener's port is 0).
        worker_port: This worker's own port (`worker_ports` + its index,
            0: a free one), set for a worker only: it listens there too, and
            advertises that port unless ``advertised_port`` is set. None
            outside a worker.
        guest: Whether user ``guest`` with password ``guest`` may log in from
            loopback addresses only, as on a fresh RabbitMQ.
        anonymous: Whether SASL ANONYMOUS is offered.
        virtual_hosts: Virtual hosts Open accepts.
        frame_max: Largest frame accepted after Open (0: no limit).
        heartbeat_seconds: Heartbeat interval proposed in Tune (0: none).
        max_unconfirmed: Published messages not yet confirmed, per
            connection, before the listener stops reading from it.
        handshake_timeout_seconds: A connection not through Open this long
            after it was made is closed (slow or silent clients).
    """

    advertised_host: str | None = None
    advertised_port: int | None = None
    worker_ports: int = 0
    worker_port: int | None = None
    guest: bool = False
    anonymous: bool = False
    virtual_hosts: frozenset[str] = frozenset({"/"})
    frame_max: int = DEFAULT_FRAME_MAX
    heartbeat_seconds: int = 60
    max_unconfirmed: int = 50_000
    handshake_timeout_seconds: float = 10.0


@attrs.frozen(kw_only=True)
class StreamUpstreamSettings:
    """How the gateway publishes to and consumes from a RabbitMQ stream node.

    Attributes:
        username: SASL PLAIN user; the password is the upstream's secret in
            the secrets file (``guest`` for the user ``guest`` if none).
        virtual_host: Opened after tuning.
        stream: Publish every routed message to this stream; when unset, to
            the stream named by the message's address.
        publisher_reference: Publisher reference for deduplication (one per
            stream, under this name); default ``msggateway.<upstream>``.
        batch_size: Messages per Publish frame, at most (and within frame_max).
        max_unconfirmed: Messages published and not yet confirmed, at most.
        max_queue: Messages waiting to be published, at most; past it
            deliveries are answered "retry later" at once.
        subscribe: Streams consumed into the routes from this upstream.
        offset: Where a subscription starts the first time: ``first``,
            ``last``, ``next``, ``offset:N`` or ``timestamp:MILLISECONDS``;
            afterwards it resumes after the offset stored under
            ``consumer_name``.
        consumer_name: Name offsets are stored under; default
            ``msggateway.<upstream>``.
        store_offset_interval_seconds: Consumed offsets are stored as chunks
            settle, at most this often.
        credit: Chunks granted to a subscription at a time.
        create_streams: Create the streams it publishes to and consumes from.
        consume_from: ``leader``: subscriptions share the publishing
            connection to the leader; ``replica``: they are read over a
            connection of their own to a replica that Metadata names (the
            leader when the stream has none).
        heartbeat_seconds: Heartbeat proposed in Tune (0: none).
        frame_max: Largest frame proposed in Tune.
    """

    username: str = "guest"
    virtual_host: str = "/"
    stream: str | None = None
    publisher_reference: str | None = None
    batch_size: int = 1000
    max_unconfirmed: int = 20_000
    max_queue: int = 100_000
    subscribe: tuple[str, ...] = ()
    offset: str = "next"
    consumer_name: str | None = None
    store_offset_interval_seconds: float = 0.2
    credit: int = 10
    create_streams: bool = False
    consume_from: str = "leader"
    heartbeat_seconds: int = 60
    frame_max: int = DEFAULT_FRAME_MAX
