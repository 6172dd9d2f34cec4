"""``msggateway stream publish|consume``: the RabbitMQ stream protocol by hand.

Against the gateway's stream listener or RabbitMQ's, on a
`BlockingStreamClient` (`gateway.protocols.stream.blocking`, the gateway's
own codec on a blocking socket); its failures end the command
(`CommandError`) with their reason.

``publish [BODY...] --stream S`` declares a publisher and publishes each
body as an AMQP 1.0 message with one data section (``--raw``: the bytes as
they are), in Publish frames within the frame max, with at most
``--window`` unconfirmed; it prints each message's outcome in order:
PublishConfirm is accepted, PublishError rejected for the codes no retry
fixes (2, 16, 17) and retry later for the others. ``--publisher NAME``
publishes under that reference, which deduplicates: the first publishing
id is one more than the sequence the server has stored for the reference
(QueryPublisherSequence), so a message the server already stored under
that name and id is never stored twice.

``consume --stream S`` subscribes from ``--offset`` (``first``, ``last``,
``next``, an offset, or ``timestamp:T`` with T in milliseconds since the
epoch or an ISO 8601 time) and prints each message (offset and body, or a
JSON object with its id, headers and timestamp), granting credit one chunk
at a time. Without ``--follow`` it stops at what the stream held when it
started (StreamStats' committed chunk); with ``--follow`` it waits for
more, until ``--count`` messages or an interrupt.
"""

from __future__ import annotations

import argparse
import datetime
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Final, TextIO

from gateway.cli.arguments import (
    DEFAULT_TIMEOUT_SECONDS,
    Commands,
    add_address_argument,
    add_header_argument,
    add_protocol_command,
    add_receiver_arguments,
    add_sender_arguments,
    add_timeout_argument,
    add_tls_arguments,
    add_window_argument,
    positive,
    secret_from_env,
)
from gateway.cli.bodies import add_body_arguments, message_bodies
from gateway.cli.connection import open_connection
from gateway.cli.errors import CommandError
from gateway.cli.output import Output, body_fields, json_value, printable, reporting
from gateway.cli.results import InOrderOutcomes, print_messages
from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.codecs.amqp import AMQPEncodeError, AMQPMessage, encode_message
from gateway.protocols.stream.blocking import (
    ENTRY_OVERHEAD_BYTES,
    PUBLISH_OVERHEAD_BYTES,
    REJECTING_CODES,
    BlockingStreamClient,
    StreamClientError,
    code_name,
)

__all__ = ["DEFAULT_BATCH", "DEFAULT_WINDOW", "add_commands", "parse_offset"]

DEFAULT_WINDOW: Final = 1000
"""Messages published and not yet confirmed, at most, by default."""

DEFAULT_BATCH: Final = 100
"""Messages per Publish frame, at most, by default."""

CREDIT: Final = 4
"""Chunks granted when subscribing; one more after each Deliver."""

PUBLISHER_ID: Final = 1
SUBSCRIPTION_ID: Final = 1


def parse_offset(text: str) -> sp.OffsetSpec:
    """``first``, ``last``, ``next``, ``N``, ``offset:N`` or ``timestamp:T`` as an offset spec.

    T is milliseconds since the epoch, or an ISO 8601 time (UTC unless it says).

    Raises:
        argparse.ArgumentTypeError: None of those.
    """
    named = {"first": sp.OffsetKind.FIRST, "last": sp.OffsetKind.LAST, "next": sp.OffsetKind.NEXT}
    if text in named:
        return sp.OffsetSpec(kind=named[text])
    kind, _, value = text.rpartition(":") if ":" in text and text[0].isalpha() else ("", "", text)
    if kind in ("", "offset") and value.isdigit():
        return sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=int(value))
    if text.startswith("timestamp:"):
        value = text.removeprefix("timestamp:")
        if value.lstrip("-").isdigit():
            return sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=int(value))
        try:
            moment = datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=datetime.UTC)
            milliseconds = int(moment.timestamp() * 1000)
            return sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=milliseconds)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not first, last, next, an offset or timestamp:MILLISECONDS|ISO-TIME"
    )


# --- the commands ------------------------------------------------------------------------


def add_commands(commands: Commands) -> None:
    """Add ``stream publish`` and ``stream consume``."""
    actions = add_protocol_command(
        commands,
        "stream",
        help="publish to or consume from a stream by hand (RabbitMQ stream protocol)",
        description="Publish to or consume from a stream over the RabbitMQ stream protocol,"
        " against the gateway's stream listener or RabbitMQ.",
    )
    publish = actions.add_parser(
        "publish",
        help="publish messages; print each one's outcome",
        description="Publish each body to --stream as an AMQP 1.0 message (or raw with --raw)"
        " and print each outcome in order: accepted (confirmed), retry or rejected (a publish"
        " error, with its code). With --publisher NAME the server deduplicates: publishing"
        " ids go on from the last one it stored for NAME. Exit status: 0 when every message"
        " was confirmed, 1 otherwise, 2 for usage errors.",
    )
    _add_connection_arguments(publish)
    add_body_arguments(publish)
    publish.add_argument(
        "--publisher",
        metavar="NAME",
        default="",
        help="publisher reference: deduplicate under NAME (default: none, no deduplication)",
    )
    publish.add_argument("--create", action="store_true", help="create the stream if need be")
    publish.add_argument(
        "--raw", action="store_true", help="publish the bodies as they are, not as AMQP messages"
    )
    add_header_argument(publish, "application property")
    add_window_argument(publish, DEFAULT_WINDOW, "most messages unconfirmed at once")
    publish.add_argument(
        "--batch",
        type=positive(int),
        default=DEFAULT_BATCH,
        metavar="N",
        help=f"most messages per Publish frame (default: {DEFAULT_BATCH})",
    )
    add_sender_arguments(publish)
    add_timeout_argument(publish)
    publish.set_defaults(run=_publish)
    consume = actions.add_parser(
        "consume",
        help="print the messages of a stream",
        description="Subscribe to --stream from --offset and print each message: offset and"
        " body on one line, or a JSON object. Without --follow, stop at the end the stream"
        " had when the command started; with it, wait for more.",
    )
    _add_connection_arguments(consume)
    consume.add_argument(
        "--offset",
        type=parse_offset,
        default=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
        metavar="SPEC",
        help="where to start: first (default), last, next, an offset N, or timestamp:T"
        " (T in milliseconds since the epoch or an ISO 8601 time, UTC unless it says)",
    )
    consume.add_argument(
        "--follow", action="store_true", help="keep waiting for new messages (until --count)"
    )
    add_receiver_arguments(consume)
    add_timeout_argument(consume, None, "seconds to wait for each message")
    consume.set_defaults(run=_consume)


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The stream, the server, the login, TLS."""
    parser.add_argument("--stream", required=True, metavar="NAME", help="the stream")
    add_address_argument(parser, "stream")
    parser.add_argument(
        "--username", default="guest", metavar="NAME", help="PLAIN login (default: guest)"
    )
    parser.add_argument(
        "--password-env",
        metavar="VAR",
        help="environment variable with the password (default: guest for guest)",
    )
    parser.add_argument("--vhost", default="/", help="virtual host (default: /)")
    add_tls_arguments(parser)


def _open(args: argparse.Namespace, timeout: float) -> BlockingStreamClient:
    """Connect and open the session as the flags say."""
    if args.password_env:
        password = secret_from_env(args.password_env)
    elif args.username == "guest":
        password = "guest"
    else:
        password = ""
    sock = open_connection(args.address, args, timeout)
    session = BlockingStreamClient(sock, timeout=timeout)
    try:
        session.open(
            username=args.username,
            password=password,
            virtual_host=args.vhost,
            properties={"connection_name": "msggateway command line"},
        )
    except BaseException:
        session.close()
        raise
    return session


_Run = Callable[[argparse.Namespace, TextIO, TextIO, IO[bytes]], int]


def _failures_end_the_command(run: _Run) -> _Run:
    """``run``, a session's failure (`StreamClientError`) ending it as a `CommandError`."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
        try:
            return run(args, out, err, stdin)
        except StreamClientError as exc:
            raise CommandError(str(exc)) from None

    return wrapped


# --- publish ---------------------------------------------------------------------------


@_failures_end_the_command
def _publish(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``stream publish``: declare, publish with a window, print outcomes in order."""
    bodies = message_bodies(args, stdin)
    session = _open(args, args.timeout)
    try:
        first_id = _declare(session, args)
        with reporting(args, out, err, total=bodies.total, desc="confirmed") as output:
            publisher = _Publisher(session, args.stream, output, output.advance, first_id=first_id)
            entries = _entries(bodies.items, dict(args.headers), raw=args.raw)
            failed = publisher.run(entries, window=args.window, batch=args.batch)
        session.request(lambda c: sp.DeletePublisher(correlation_id=c, publisher_id=PUBLISHER_ID))
    finally:
        session.close()
    return int(failed)


def _declare(session: BlockingStreamClient, args: argparse.Namespace) -> int:
    """Create the stream if asked, declare the publisher; return the first publishing id."""
    stream: str = args.stream
    if args.create:
        created = session.request(lambda c: sp.Create(correlation_id=c, stream=stream))
        if created.code not in (sp.ResponseCode.OK, sp.ResponseCode.STREAM_ALREADY_EXISTS):
            raise CommandError(f"cannot create stream {stream} ({code_name(created.code)})")
    declared = session.request(
        lambda c: sp.DeclarePublisher(
            correlation_id=c, publisher_id=PUBLISHER_ID, reference=args.publisher, stream=stream
        )
    )
    if declared.code != sp.ResponseCode.OK:
        raise CommandError(f"cannot publish to {stream} ({code_name(declared.code)})")
    if not args.publisher:
        return 1
    stored = session.request(
        lambda c: sp.QueryPublisherSequence(
            correlation_id=c, reference=args.publisher, stream=stream
        )
    )
    if stored.code != sp.ResponseCode.OK:
        raise CommandError(f"cannot query publisher {args.publisher} ({code_name(stored.code)})")
    return int(stored.sequence) + 1


def _entries(
    bodies: Iterable[bytes], headers: dict[str, str], *, raw: bool
) -> Iterator[bytes | str]:
    """Each body as the entry stored: an AMQP message, or the raw bytes; a str says why not."""
    properties = headers or None
    for body in bodies:
        if raw:
            yield body
            continue
        try:
            yield encode_message(AMQPMessage(application_properties=properties, body=body))
        except AMQPEncodeError as exc:
            yield f"cannot be an AMQP message: {exc}"


class _Publisher:
    """Publishes entries with a window and prints each outcome in publishing-id order."""

    def __init__(
        self,
        session: BlockingStreamClient,
        stream: str,
        output: Output,
        advance: Callable[[int], object],
        *,
        first_id: int,
    ) -> None:
        self._session = session
        self._stream = stream
        self._first_id = first_id
        self._outcomes = InOrderOutcomes(output, advance, first=first_id)

    def run(self, entries: Iterable[bytes | str], *, window: int, batch: int) -> bool:
        """Publish every entry, wait for every outcome; return whether any was not accepted."""
        source = iter(entries)
        return self._outcomes.send_within(
            window,
            lambda: self._publish_some(source, window, batch),
            lambda: self._settle(self._session.next("publish confirms")),
        )

    def _publish_some(self, source: Iterator[bytes | str], window: int, batch: int) -> bool:
        """Send one Publish frame of what the window allows; True once the input is done."""
        ids: list[int] = []
        messages: list[bytes] = []
        size = PUBLISH_OVERHEAD_BYTES
        limit = self._session.frame_max or None
        while len(ids) < batch and self._outcomes.waiting < window:
            entry = next(source, None)
            if entry is None:
                self._flush(ids, messages)
                return True
            publishing_id = self._outcomes.take_number()
            if isinstance(entry, str):
                self._record(publishing_id, "error", None, entry)
                continue
            needed = ENTRY_OVERHEAD_BYTES + len(entry)
            if limit is not None and PUBLISH_OVERHEAD_BYTES + needed > limit:
                reason = f"{len(entry)} bytes do not fit the frame max of {limit}"
                self._record(publishing_id, "error", None, reason)
                continue
            if limit is not None and size + needed > limit:
                self._flush(ids, messages)
                ids, messages, size = [], [], PUBLISH_OVERHEAD_BYTES
            ids.append(publishing_id)
            messages.append(entry)
            size += needed
        self._flush(ids, messages)
        return False

    def _flush(self, ids: list[int], messages: list[bytes]) -> None:
        if ids:
            self._session.publish(PUBLISHER_ID, ids, messages)

    def _settle(self, event: sp.Event) -> None:
        """Record what a PublishConfirm or PublishError says about our ids."""
        if isinstance(event, sp.PublishConfirm) and event.publisher_id == PUBLISHER_ID:
            for publishing_id in event.publishing_ids:
                self._record(publishing_id, "accepted", None, "")
        elif isinstance(event, sp.PublishError) and event.publisher_id == PUBLISHER_ID:
            for publishing_id, code in zip(event.publishing_ids, event.codes, strict=True):
                outcome = "rejected" if code in REJECTING_CODES else "retry"
                self._record(publishing_id, outcome, code, code_name(code))

    def _record(self, publishing_id: int, outcome: str, code: int | None, reason: str) -> None:
        """Settle a message's outcome as its line and JSON record say it."""
        record: dict[str, object] = {
            "message": publishing_id - self._first_id + 1,
            "stream": self._stream,
            "publishing_id": publishing_id,
            "outcome": outcome,
        }
        text = f"{publishing_id} {outcome}"
        if code is not None:
            record["code"] = code
        if reason:
            record["reason"] = reason
            text += f": {reason}" if code is None else f": {reason} ({code})"
        self._outcomes.settle(publishing_id, outcome, text, record)


# --- consume ---------------------------------------------------------------------------


@_failures_end_the_command
def _consume(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``stream consume``: subscribe, print messages, grant credit chunk by chunk."""
    session = _open(args, args.timeout or DEFAULT_TIMEOUT_SECONDS)
    try:
        plan = _plan(session, args.stream, args.offset, follow=args.follow)
        if plan is None:
            return 0  # nothing there to read, and not following
        spec, skip_below, end = plan
        subscribed = session.request(
            lambda c: sp.Subscribe(
                correlation_id=c,
                subscription_id=SUBSCRIPTION_ID,
                stream=args.stream,
                offset_spec=spec,
                credit=CREDIT,
            )
        )
        if subscribed.code != sp.ResponseCode.OK:
            raise CommandError(f"cannot consume {args.stream} ({code_name(subscribed.code)})")
        session.set_timeout(args.timeout)
        with reporting(args, out, err, total=args.count or None, desc="received") as output:
            reader = _Reader(args.stream, output, output.advance)
            reader.read(session, skip_below=skip_below, end=end, count=args.count)
    finally:
        session.close()
    return 0


def _plan(
    session: BlockingStreamClient, stream: str, spec: sp.OffsetSpec, *, follow: bool
) -> tuple[sp.OffsetSpec, int, int | None] | None:
    """Where to subscribe, the first offset to print, and the chunk to stop after.

    Following: the spec as given, no end. Otherwise the end is the
    stream's committed chunk now (StreamStats); an offset past it starts at
    that chunk (so that it comes, and ends the reading), a timestamp is
    resolved to its chunk first (ResolveOffsetSpec); None when there is
    nothing to read: an empty stream, ``next``, or a time after the last chunk.
    """
    if follow:
        return (
            spec,
            spec.value if spec.value is not None and spec.kind is sp.OffsetKind.OFFSET else 0,
            None,
        )
    stats = session.request(lambda c: sp.StreamStats(correlation_id=c, stream=stream))
    if stats.code != sp.ResponseCode.OK:
        raise CommandError(f"cannot read {stream} ({code_name(stats.code)})")
    statistics = stats.statistics
    end = int(statistics.get("committed_chunk_id", statistics.get("last_chunk_id", -1)))
    if end < 0 or spec.kind is sp.OffsetKind.NEXT:
        return None
    if spec.kind is sp.OffsetKind.OFFSET:
        assert spec.value is not None
        start = sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=min(spec.value, end))
        return start, spec.value, end
    if spec.kind is sp.OffsetKind.TIMESTAMP:
        resolved = session.request(
            lambda c: sp.ResolveOffsetSpec(correlation_id=c, stream=stream, offset_spec=spec)
        )
        if resolved.code != sp.ResponseCode.OK:
            raise CommandError(f"cannot resolve {stream}'s timestamp ({code_name(resolved.code)})")
        if resolved.offset > end:
            return None
        return sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=resolved.offset), 0, end
    return spec, 0, end


class _Reader:
    """Prints the messages of delivered chunks."""

    def __init__(self, stream: str, output: Output, advance: Callable[[int], object]) -> None:
        self._stream = stream
        self._output = output
        self._advance = advance

    def read(
        self, session: BlockingStreamClient, *, skip_below: int, end: int | None, count: int
    ) -> None:
        """Read chunks until the one at ``end`` (None: for ever) or ``count`` messages (0: all)."""
        messages = self._messages(session, skip_below=skip_below, end=end)
        print_messages(self._output, self._advance, messages, count)

    def _messages(
        self, session: BlockingStreamClient, *, skip_below: int, end: int | None
    ) -> Iterator[tuple[str, dict[str, object]]]:
        """Each message's line and record, granting credit after each chunk up to ``end``."""
        while True:
            event = session.next("messages")
            if not isinstance(event, sp.Deliver) or event.subscription_id != SUBSCRIPTION_ID:
                continue
            header = osiris.ChunkHeader.unpack(event.chunk)
            if header.chunk_type == osiris.USER:
                yield from self._chunk_messages(event.chunk, header, skip_below)
            if end is not None and header.next_offset > end:
                return
            session.send(sp.Credit(subscription_id=SUBSCRIPTION_ID, credit=1))

    def _chunk_messages(
        self, chunk: bytes | memoryview, header: osiris.ChunkHeader, skip_below: int
    ) -> Iterator[tuple[str, dict[str, object]]]:
        """A user chunk's messages from ``skip_below`` on, each as its line and record."""
        from gateway.protocols.stream.mapping import message_from_entry

        # A Deliver carries the header and the data entries, no bloom filter (notes, 11).
        data = memoryview(chunk)[osiris.HEADER_BYTES : osiris.HEADER_BYTES + header.data_length]
        timestamp = header.timestamp / 1000
        try:
            for index, entry in enumerate(osiris.iter_entries(data)):
                offset = header.first_offset + index
                if offset < skip_below:
                    continue
                message = message_from_entry(
                    entry, stream=self._stream, timestamp=timestamp, offset=offset
                )
                record: dict[str, object] = {
                    "stream": self._stream,
                    "offset": offset,
                    "timestamp": message.timestamp,
                    "id": message.id,
                }
                if message.headers:
                    record["headers"] = json_value(dict(message.headers))
                if message.sender is not None:
                    record["sender"] = message.sender
                if message.recipients:
                    record["recipients"] = list(message.recipients)
                yield f"{offset} {printable(message.body)}", record | body_fields(message.body)
        except osiris.OsirisError as exc:
            raise CommandError(f"a bad chunk from the server: {exc}") from None
