"""In-memory tests of the QMQP streaming listener: `gateway.protocols.qmqp.server`.

Every connection is a `QMQPServerProtocol` built by one `QMQPServerFactory`
and attached to a `StringTransport`; time is a `Clock`; messages go through
a real `Router` to small destinations: one answers at once by the
recipient's domain, the other holds each outcome until the test fires it.
What the server wrote is decoded with the client-role codec. The behaviour
checked is the spec's (../shared/specs/qmqp-streaming.txt), the module's
docstring and docs/protocols/qmqp.rst.
"""

from __future__ import annotations

import random
import select
import socket
from collections.abc import Iterable, Sequence

import attrs
import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs import qmqp
from gateway.codecs.framing import encode_netstrings
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.inbox import Inbox
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.listener import PUSH_MAX_ANSWERS
from gateway.protocols.qmqp.server import QMQPServerFactory, QMQPServerProtocol
from gateway.protocols.qmqp.settings import QMQPListenerSettings
from tests.doubles import NO_LOGIN_WAIT, WritingTransport, deliver_each

LISTENER = "mail-in"
ANSWERS = "answers"
HELD = "held"
SETTINGS = QMQPListenerSettings()
SECRETS = Secrets(logins={"myusername": b"the_password"})
ROUTE_TIMEOUT_SECONDS = 10.0


def _route(name: str, pattern: str, destination: str) -> Route:
    return Route(
        name=name,
        source=LISTENER,
        pattern=AddressPattern(pattern),
        destination=destination,
        timeout_seconds=ROUTE_TIMEOUT_SECONDS,
    )


ROUTES = (
    _route("spec", "#@drh.net", ANSWERS),
    _route("ok", "#@ok.example", ANSWERS),
    _route("busy", "#@busy.example", ANSWERS),
    _route("bad", "#@bad.example", ANSWERS),
    _route("held", "#@held.example", HELD),
)
"""drh.net and ok.example are accepted, busy.example retried, bad.example
rejected at once; held.example waits for the test. Anything else has no route."""

# The spec's sample sessions, from its hex dumps ("Sample Session", "Authentication").
CLIENT_SESSION = bytes.fromhex(
    """
    31 32 32 3a 31 3a 4d 2c  34 3a 6d 73 67 31 2c 37
    32 3a 46 72 6f 6d 3a 20  72 6f 6f 74 40 64 72 68
    2e 6e 65 74 0a 54 6f 3a  20 64 68 61 72 72 69 73
    40 64 72 68 2e 6e 65 74  0a 73 75 62 6a 65 63 74
    3a 20 68 69 0a 0a 74 68  69 73 20 69 73 20 74 68
    65 20 6d 65 73 73 61 67  65 0a 2c 31 32 3a 72 6f
    6f 74 40 64 72 68 2e 6e  65 74 2c 31 35 3a 64 68
    61 72 72 69 73 40 64 72  68 2e 6e 65 74 2c 2c 31
    32 32 3a 31 3a 4d 2c 34  3a 6d 73 67 32 2c 37 32
    3a 46 72 6f 6d 3a 20 72  6f 6f 74 40 64 72 68 2e
    6e 65 74 0a 54 6f 3a 20  64 68 61 72 72 69 73 40
    64 72 68 2e 6e 65 74 0a  73 75 62 6a 65 63 74 3a
    20 68 69 0a 0a 74 68 69  73 20 69 73 20 74 68 65
    20 6d 65 73 73 61 67 65  0a 2c 31 32 3a 72 6f 6f
    74 40 64 72 68 2e 6e 65  74 2c 31 35 3a 64 68 61
    72 72 69 73 40 64 72 68  2e 6e 65 74 2c 2c 31 3a
    44 2c
    """
)
SERVER_SESSION = bytes.fromhex(
    """
    31 39 3a 31 3a 52 2c 34  3a 6d 73 67 31 2c 31 3a
    4b 2c 31 3a 31 2c 2c 31  39 3a 31 3a 52 2c 34 3a
    6d 73 67 32 2c 31 3a 4b  2c 31 3a 30 2c 2c 31 3a
    44 2c
    """
)
AUTH_REQUEST = bytes.fromhex(
    """
    33 34 3a 31 3a 41 2c 31  30 3a 6d 79 75 73 65 72
    6e 61 6d 65 2c 31 32 3a  74 68 65 5f 70 61 73 73
    77 6f 72 64 2c 2c
    """
)
WRONG_AUTH_REQUEST = AUTH_REQUEST.replace(b"the_password", b"the_passw0rd")
AUTH_OK = b"8:1:A,1:1,,"
AUTH_REFUSED = b"8:1:A,1:0,,"
DONE = b"1:D,"
BODY = b"From: app@example.org\nSubject: hi\n\nhello\n"


# --- test doubles and helpers ------------------------------------------------------------


@implementer(IDestination)
class AnsweringDestination:
    """A route destination that answers at once, by the first recipient's domain.

    ``ok.example`` and ``drh.net`` are accepted, ``busy.example`` is told to
    retry (a full queue), ``bad.example`` is rejected.
    """

    def __init__(self, name: str = ANSWERS) -> None:
        self.name = name
        self.messages: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch, one message at a time."""
        return deliver_each(self.deliver_one, messages)

    def deliver_one(self, message: Message) -> Deferred[Outcome]:
        """Record the message and answer by its domain."""
        self.messages.append(message)
        domain = message.recipients[0].rpartition("@")[2]
        if domain == "busy.example":
            return succeed(Outcome.retry("queue full"))
        if domain == "bad.example":
            return succeed(Outcome.rejected("mailbox unknown"))
        return succeed(Outcome.accepted())


@implementer(IDestination)
class HeldDestination:
    """A route destination that records messages and lets the test decide outcomes."""

    def __init__(self, name: str = HELD) -> None:
        self.name = name
        self.messages: list[Message] = []
        self.outcomes: list[Deferred[Outcome]] = []
        self.arrived: Deferred[None] | None = None
        """Fired (once) when the next message arrives, if the test sets it."""

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch, one message at a time."""
        return deliver_each(self.deliver_one, messages)

    def deliver_one(self, message: Message) -> Deferred[Outcome]:
        """Record the message; its outcome comes when the test fires it."""
        outcome: Deferred[Outcome] = Deferred()
        self.messages.append(message)
        self.outcomes.append(outcome)
        arrived, self.arrived = self.arrived, None
        if arrived is not None:
            arrived.callback(None)
        return outcome


class Client:
    """One client connection to the listener, seen from the test."""

    def __init__(self, protocol: QMQPServerProtocol, transport: StringTransport) -> None:
        self.protocol = protocol
        self.transport = transport
        self._codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)

    def send(self, data: bytes) -> None:
        """Deliver bytes from the client, as the reactor would."""
        self.protocol.dataReceived(data)

    def received(self) -> bytes:
        """Return what the server wrote since the last call."""
        data: bytes = self.transport.value()
        self.transport.clear()
        return data

    def blocks(self) -> list[qmqp.Block]:
        """Decode what the server wrote since the last call."""
        return self._codec.receive_data(self.received())

    def replies(self) -> list[tuple[bytes, bytes, int]]:
        """Decode the replies written since the last call as (id, status, pending)."""
        out: list[tuple[bytes, bytes, int]] = []
        for block in self.blocks():
            assert isinstance(block, qmqp.ReplyBlock), block
            out.append((block.id, block.status, block.pending))
        return out

    def lose(self) -> None:
        """Simulate the connection going away."""
        self.protocol.connectionLost(Failure(ConnectionLost("gone")))


class ListenerWorld:
    """One QMQP listener with its router, destinations, secrets, clock and metrics."""

    def __init__(
        self, settings: QMQPListenerSettings = SETTINGS, routes: Iterable[Route] = ROUTES
    ) -> None:
        self.clock = Clock()
        self.metrics = GatewayMetrics()
        self.answers = AnsweringDestination()
        self.held = HeldDestination()
        table = bind_routes(routes, {ANSWERS: self.answers, HELD: self.held})
        self.router = Router(table, self.clock, self.metrics)
        self.factory = QMQPServerFactory(
            name=LISTENER,
            settings=settings,
            router=self.router,
            secrets=SECRETS,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.factory.login_failures = NO_LOGIN_WAIT  # test_logins.py tests the waits

    def connect(self) -> Client:
        """Open a connection."""
        transport = StringTransport()
        protocol = self.factory.buildProtocol(IPv4Address("TCP", "192.0.2.1", 40000))
        protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
        return Client(protocol, transport)

    def sample(self, name: str, **labels: str) -> float:
        """Return a metric's current value for the listener (0 when never set)."""
        value = self.metrics.registry.get_sample_value(name, {"endpoint": LISTENER, **labels})
        return 0.0 if value is None else value


def mail(block_id: str, *recipients: str, body: bytes = BODY) -> bytes:
    """One encoded message block."""
    return qmqp.encode(
        qmqp.MessageBlock(
            id=block_id.encode(),
            message=body,
            sender=b"app@example.org",
            recipients=tuple(r.encode() for r in recipients),
        )
    )


def reply(block_id: str, result: bytes, pending: int) -> bytes:
    """One encoded reply block with a whole result string (status and description)."""
    return encode_netstrings((b"R", block_id.encode(), result, b"%d" % pending))


@pytest.fixture
def world() -> ListenerWorld:
    """A listener without required authentication and with the default limits."""
    return ListenerWorld()


# --- the spec's sample session ------------------------------------------------------------


def test_protocol_is_a_push_producer_registered_with_its_transport(world: ListenerWorld) -> None:
    """The protocol provides IPushProducer and registers itself as a streaming producer."""
    client = world.connect()
    assert verifyObject(IPushProducer, client.protocol)
    assert client.transport.producer is client.protocol
    assert client.transport.streaming


def test_sample_session_byte_for_byte(world: ListenerWorld) -> None:
    """The spec's client sample in one read gives exactly the server sample, then a close."""
    client = world.connect()
    client.send(CLIENT_SESSION)
    assert client.received() == SERVER_SESSION
    assert client.transport.disconnecting
    assert client.transport.producer is None  # unregistered before the close
    [first, second] = world.answers.messages
    assert (first.id, first.sender, first.recipients) == (
        "msg1",
        "root@drh.net",
        ("dharris@drh.net",),
    )
    assert second.id == "msg2"
    assert first.body.startswith(b"From: root@drh.net\nTo: dharris@drh.net\n")


def test_sample_session_one_byte_at_a_time(world: ListenerWorld) -> None:
    """Blocks are handled as they complete: msg1 is answered before msg2 has arrived.

    The pending count only includes messages received, so each reply says 0.
    """
    client = world.connect()
    output = b""
    for index in range(len(CLIENT_SESSION)):
        client.send(CLIENT_SESSION[index : index + 1])
        output += client.received()
        if index == 0x7E:  # the last byte of msg1's block
            assert output == b"19:1:R,4:msg1,1:K,1:0,,"
    assert output == b"19:1:R,4:msg1,1:K,1:0,,19:1:R,4:msg2,1:K,1:0,,1:D,"
    assert client.transport.disconnecting


def test_all_replies_of_one_read_are_one_write(world: ListenerWorld) -> None:
    """Replies ready during one read go out together, in one write."""
    client = world.connect()
    writes: list[bytes] = []
    client.transport.write = writes.append  # type: ignore[method-assign]
    client.send(mail("a", "x@ok.example") + mail("b", "y@ok.example"))
    assert writes == [reply("a", b"K", 1) + reply("b", b"K", 0)]


# --- outcomes: K, Z, D -----------------------------------------------------------------------


def test_k_z_d_follow_the_route_outcome(world: ListenerWorld) -> None:
    """K when accepted; Z with the reason for a retry; D with the reason for a rejection."""
    client = world.connect()
    client.send(
        mail("ok", "a@ok.example") + mail("busy", "a@busy.example") + mail("bad", "a@bad.example")
    )
    assert client.received() == (
        reply("ok", b"K", 2)
        + reply("busy", b"Zqueue full", 1)
        + reply("bad", b"Dmailbox unknown", 0)
    )
    assert not client.transport.disconnecting


def test_no_route_for_a_recipient_is_d_naming_it(world: ListenerWorld) -> None:
    """A recipient without a route makes the whole message D, naming it; nothing is delivered."""
    client = world.connect()
    client.send(mail("mixed", "a@ok.example", "bob@elsewhere.example"))
    assert client.received() == reply("mixed", b"Dno route for recipient bob@elsewhere.example", 0)
    assert world.answers.messages == []


def test_unrouted_description_names_every_recipient_without_hash(world: ListenerWorld) -> None:
    """The D for unrouted recipients names them all, without ``#`` (spec, "Result String")."""
    client = world.connect()
    client.send(mail("m", "a#1@nowhere.example", "b@nowhere.example"))
    [block] = client.blocks()
    assert isinstance(block, qmqp.ReplyBlock)
    assert block.status == qmqp.D
    assert block.description.startswith(b"no route for recipient ")
    assert b"@nowhere.example, b@nowhere.example" in block.description
    assert b"#" not in block.description


def test_one_reply_covers_all_recipients(world: ListenerWorld) -> None:
    """Recipients on several routes get one reply, the worst outcome, once all are known."""
    client = world.connect()
    client.send(mail("m", "a@ok.example", "b@held.example", "c@ok.example"))
    assert client.received() == b""
    [delivered] = world.answers.messages
    assert delivered.recipients == ("a@ok.example", "c@ok.example")  # one delivery per route
    world.held.outcomes[0].callback(Outcome.rejected("no such user"))
    world.clock.advance(0)
    assert client.received() == reply("m", b"Dno such user", 0)


def test_replies_go_out_in_completion_order(world: ListenerWorld) -> None:
    """Message 2 finishing first is answered first; pending counts what is still open."""
    client = world.connect()
    client.send(mail("m1", "a@held.example"))
    client.send(mail("m2", "b@held.example"))
    assert client.received() == b""
    first, second = world.held.outcomes
    second.callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.replies() == [(b"m2", qmqp.K, 1)]
    first.callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.replies() == [(b"m1", qmqp.K, 0)]


def test_one_read_is_one_batch_answered_together(world: ListenerWorld) -> None:
    """The messages of one read reach their route as one batch and are answered when it is."""
    client = world.connect()
    client.send(mail("m1", "a@held.example") + mail("m2", "b@held.example"))
    assert [m.id for m in world.held.messages] == ["m1", "m2"]
    first, second = world.held.outcomes
    second.callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.replies() == []
    first.callback(Outcome.rejected("nope"))
    world.clock.advance(0)
    assert client.replies() == [(b"m1", qmqp.D, 1), (b"m2", qmqp.K, 0)]


def test_the_messages_of_a_read_take_its_time(world: ListenerWorld) -> None:
    """Every message of one read is stamped with the read's time; the next read with its own."""
    client = world.connect()
    world.clock.advance(5)
    first = mail("m1", "a@held.example")
    client.send(first + mail("m2", "b@held.example") + first[:7])
    world.clock.advance(2)
    client.send(first[7:] + mail("m4", "c@held.example"))
    assert [(m.id, m.timestamp) for m in world.held.messages] == [
        ("m1", 5.0),
        ("m2", 5.0),
        ("m1", 7.0),
        ("m4", 7.0),
    ]


def test_a_route_does_not_wait_for_another_routes_batch(world: ListenerWorld) -> None:
    """Messages of one read on two routes: the route that answers first is answered first."""
    client = world.connect()
    client.send(mail("h", "a@held.example") + mail("k", "a@ok.example"))
    assert client.replies() == [(b"k", qmqp.K, 1)]
    world.held.outcomes[0].callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.replies() == [(b"h", qmqp.K, 0)]


def test_pending_counts_messages_of_the_same_read(world: ListenerWorld) -> None:
    """A reply's pending count includes messages that arrived in the same read, after it."""
    client = world.connect()
    client.send(mail("h", "a@held.example"))
    client.send(mail("a", "a@ok.example") + mail("b", "b@ok.example") + mail("c", "c@held.example"))
    assert client.replies() == [(b"a", qmqp.K, 3), (b"b", qmqp.K, 2)]
    world.held.outcomes[1].callback(Outcome.accepted())
    world.held.outcomes[0].callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.replies() == [(b"c", qmqp.K, 1), (b"h", qmqp.K, 0)]


def test_a_batch_answered_outside_a_read_is_written_at_once(world: ListenerWorld) -> None:
    """A route's batch answered later is replied to at once, in one write, in order."""
    client = world.connect()
    client.send(mail("m1", "a@held.example") + mail("m2", "b@held.example"))
    world.held.outcomes[0].callback(Outcome.accepted())
    assert client.received() == b""
    world.held.outcomes[1].callback(Outcome.retry("later"))
    assert client.received() == reply("m1", b"K", 1) + reply("m2", b"Zlater", 0)


@pytest_twisted.ensureDeferred
async def test_a_batch_answered_outside_a_read_is_in_the_socket_at_once() -> None:
    """Over real TCP the replies reach the client's socket as the batch is answered.

    Not when the reactor next polls: a durable route answers in a timed call
    that goes on to other work (`ListenerConnection.flush_now`).
    """
    from twisted.internet import reactor

    world = ListenerWorld()
    arrived: Deferred[None] = Deferred()
    world.held.arrived = arrived
    port = reactor.listenTCP(0, world.factory, interface="127.0.0.1")
    client = socket.create_connection(("127.0.0.1", port.getHost().port))
    try:
        client.sendall(mail("m1", "a@held.example"))
        await arrived  # fired inside the read
        await deferLater(reactor, 0, lambda: None)  # the read is over
        world.held.outcomes[0].callback(Outcome.accepted())
        readable, _, _ = select.select([client], [], [], 0)  # no reactor turn since
        assert readable == [client]
        assert client.recv(4096) == reply("m1", b"K", 0)
    finally:
        client.close()
        await port.stopListening()


@pytest.mark.parametrize("state", ["open", "disconnecting", "producer paused", "not connected"])
def test_replies_are_pushed_only_on_an_open_unpaused_connection(state: str) -> None:
    """`flush_now` hands the write to the socket only when the reactor would anyway, at once."""
    world = ListenerWorld()
    transport = WritingTransport()
    protocol = world.factory.buildProtocol(IPv4Address("TCP", "192.0.2.1", 40000))
    protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
    protocol.dataReceived(mail("m1", "a@held.example"))
    transport.disconnecting = state == "disconnecting"
    transport.producerPaused = state == "producer paused"
    transport.connected = state != "not connected"
    world.held.outcomes[0].callback(Outcome.accepted())
    assert transport.value() == reply("m1", b"K", 0)  # written either way
    assert transport.pushed == (1 if state == "open" else 0)


def test_a_large_batch_is_left_to_the_reactor_to_write() -> None:
    """Past `PUSH_MAX_ANSWERS` replies, the batch is written but not pushed to the socket."""
    for count, pushed in ((PUSH_MAX_ANSWERS, 1), (PUSH_MAX_ANSWERS + 1, 0)):
        world = ListenerWorld()
        transport = WritingTransport()
        protocol = world.factory.buildProtocol(IPv4Address("TCP", "192.0.2.1", 40000))
        protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
        protocol.dataReceived(b"".join(mail(f"m{i}", "a@held.example") for i in range(count)))
        for outcome in world.held.outcomes:
            outcome.callback(Outcome.accepted())
        assert len(qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(transport.value())) == count
        assert transport.pushed == pushed, count


def test_single_answers_outside_a_read_wait_for_the_next_reactor_turn(
    world: ListenerWorld,
) -> None:
    """A message answered on its own (recipients on two routes) is written on the next turn."""
    client = world.connect()
    client.send(mail("m1", "a@held.example", "b@ok.example"))
    client.send(mail("m2", "c@held.example", "d@ok.example"))
    assert client.received() == b""
    world.held.outcomes[0].callback(Outcome.accepted())
    world.held.outcomes[1].callback(Outcome.retry("later"))
    assert client.received() == b""
    world.clock.advance(0)
    assert client.received() == reply("m1", b"K", 1) + reply("m2", b"Zlater", 0)


_DOMAINS = ("ok.example", "busy.example", "bad.example")


@settings(max_examples=60, deadline=None)
@given(
    answers=st.lists(st.tuples(st.sampled_from(_DOMAINS), st.booleans()), min_size=1, max_size=6),
    order=st.randoms(use_true_random=False),
)
def test_batch_answers_write_what_single_answers_write(
    answers: list[tuple[str, bool]], order: random.Random
) -> None:
    """Answering a batch at once writes and counts the same replies as answering each alone.

    Each message goes to the held route (answered in a random order) or to
    the answering one; one listener answers batches with `_answer_batch`,
    the other (its inbox without it) one message at a time.
    """
    written = []
    counted = []
    for batched in (True, False):
        world = ListenerWorld()
        client = world.connect()
        if not batched:
            protocol = client.protocol
            protocol._inbox = Inbox(world.router, LISTENER, protocol._answer)
        data = b"".join(
            mail(f"m{index}", f"x@{'held.example' if held else domain}")
            for index, (domain, held) in enumerate(answers)
        )
        client.send(data)
        held_domains = [domain for domain, held in answers if held]
        fired = list(zip(world.held.outcomes, held_domains, strict=True))
        order.seed(len(answers))
        order.shuffle(fired)
        outcome = {
            "ok.example": Outcome.accepted(),
            "busy.example": Outcome.retry("queue full"),
            "bad.example": Outcome.rejected("mailbox unknown"),
        }
        for deferred, domain in fired:
            deferred.callback(outcome[domain])
        world.clock.advance(0)
        written.append(client.received())
        counted.append([world.sample("msggateway_qmqp_replies_total", status=s) for s in "KZD"])
        assert client.protocol._outstanding == 0
        assert client.protocol._in_flight == client.protocol._in_flight_bytes == 0
    assert written[0] == written[1]
    assert counted[0] == counted[1]
    assert sum(counted[0]) == len(answers)


def test_route_time_out_is_z(world: ListenerWorld) -> None:
    """No outcome within the route's time-out: Z saying so."""
    client = world.connect()
    client.send(mail("slow", "a@held.example"))
    world.clock.advance(ROUTE_TIMEOUT_SECONDS - 0.5)
    assert client.received() == b""
    world.clock.advance(0.5)
    [block] = client.blocks()
    assert isinstance(block, qmqp.ReplyBlock)
    assert (block.id, block.status, block.pending) == (b"slow", qmqp.Z, 0)
    assert b"no outcome from held within 10 seconds" in block.description


def test_failing_delivery_is_z() -> None:
    """A delivery that fails unexpectedly is a temporary failure, logged, never a hang."""

    @implementer(IDestination)
    class Broken:
        name = HELD

        def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
            """Deliver a batch, one message at a time."""
            return deliver_each(self.deliver_one, messages)

        def deliver_one(self, message: Message) -> Deferred[Outcome]:
            """Fail as a bug would."""
            return fail(RuntimeError("bug"))

    world = ListenerWorld()
    world.router.replace_table(bind_routes(ROUTES, {ANSWERS: world.answers, HELD: Broken()}))
    client = world.connect()
    with capturedLogs() as events:
        client.send(mail("m", "a@held.example"))
    [block] = client.blocks()
    assert isinstance(block, qmqp.ReplyBlock)
    assert block.status == qmqp.Z
    assert any(event.get("log_failure") is not None for event in events)


def test_outcomes_after_the_client_left_are_dropped(world: ListenerWorld) -> None:
    """Outcomes arriving after the connection is lost write nothing and break nothing."""
    client = world.connect()
    client.send(mail("m", "a@held.example"))
    client.lose()
    world.held.outcomes[0].callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.received() == b""
    assert world.factory.connections == set()


# --- the done block ----------------------------------------------------------------------------


def test_done_without_outstanding_work(world: ListenerWorld) -> None:
    """A lone done block is answered with the server's done block and a close."""
    client = world.connect()
    client.send(DONE)
    assert client.received() == DONE
    assert client.transport.disconnecting


def test_done_waits_for_outstanding_replies(world: ListenerWorld) -> None:
    """After the done block every message is still answered; the done block and close come last."""
    client = world.connect()
    client.send(mail("m1", "a@held.example"))
    client.send(mail("m2", "b@held.example") + DONE)
    assert client.received() == b""
    assert not client.transport.disconnecting
    assert client.transport.producerState == "paused"  # nothing more is read

    world.held.outcomes[1].callback(Outcome.accepted())
    world.clock.advance(0)
    assert client.received() == reply("m2", b"K", 1)
    assert not client.transport.disconnecting

    world.held.outcomes[0].callback(Outcome.rejected("nope"))
    assert client.received() == reply("m1", b"Dnope", 0) + DONE
    assert client.transport.disconnecting


def test_block_after_done_gets_d(world: ListenerWorld) -> None:
    """A message block after the done block is answered D; then come the done block and close."""
    client = world.connect()
    client.send(mail("m1", "a@ok.example") + DONE + mail("late", "a@ok.example"))
    # Replies may come in any order (spec); the refusal is known before the read's batch is routed.
    assert client.received() == (
        reply("late", b"Dblock after the done block", 1) + reply("m1", b"K", 0) + DONE
    )
    assert client.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", kind="after-done") == 1
    assert len(world.answers.messages) == 1


# --- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "answer"),
    [(AUTH_REQUEST, AUTH_OK), (WRONG_AUTH_REQUEST, AUTH_REFUSED)],
    ids=["right-password", "wrong-password"],
)
def test_sample_auth_request(world: ListenerWorld, request_bytes: bytes, answer: bytes) -> None:
    """The spec's A block: "1" for success, "0" for failure (spec ambiguity: the prose wins)."""
    client = world.connect()
    client.send(request_bytes)
    assert client.received() == answer
    assert not client.transport.disconnecting
    expected_identity = "myusername" if answer == AUTH_OK else None
    assert client.protocol.identity == expected_identity


def test_refused_auth_is_counted(world: ListenerWorld) -> None:
    """A refused A block counts an ``unauthorized`` protocol error."""
    client = world.connect()
    client.send(WRONG_AUTH_REQUEST)
    assert world.sample("msggateway_protocol_errors_total", kind="unauthorized") == 1


def test_auth_is_optional_without_require_auth(world: ListenerWorld) -> None:
    """Without ``require_auth`` messages are served with or without an A block."""
    client = world.connect()
    client.send(mail("m1", "a@ok.example") + WRONG_AUTH_REQUEST + mail("m2", "a@ok.example"))
    # The A reply is written as it is handled; the read's messages are answered as one batch.
    assert client.received() == AUTH_REFUSED + reply("m1", b"K", 1) + reply("m2", b"K", 0)


def test_require_auth_refuses_messages_before_a_successful_auth() -> None:
    """With ``require_auth``: D before any A block and after a refused one, K after success."""
    world = ListenerWorld(settings=QMQPListenerSettings(require_auth=True))
    client = world.connect()
    client.send(
        mail("early", "a@ok.example")
        + WRONG_AUTH_REQUEST
        + mail("refused", "a@ok.example")
        + AUTH_REQUEST
        + mail("late", "a@ok.example")
    )
    early, refused_auth, refused, auth, late = client.blocks()
    assert early == qmqp.ReplyBlock(
        id=b"early",
        status=qmqp.D,
        description=b"authentication required: send an A block first",
        pending=2,
    )
    assert refused_auth == qmqp.AuthReplyBlock(success=False)
    assert isinstance(refused, qmqp.ReplyBlock)
    assert (refused.status, refused.pending) == (qmqp.D, 1)
    assert auth == qmqp.AuthReplyBlock(success=True)
    assert late == qmqp.ReplyBlock(id=b"late", status=qmqp.K, description=b"", pending=0)
    assert len(world.answers.messages) == 1
    assert world.sample("msggateway_protocol_errors_total", kind="unauthenticated") == 2


def test_require_auth_is_per_connection() -> None:
    """One connection's successful A block does not authenticate another."""
    world = ListenerWorld(settings=QMQPListenerSettings(require_auth=True))
    first = world.connect()
    first.send(AUTH_REQUEST)
    assert first.received() == AUTH_OK
    second = world.connect()
    second.send(mail("m", "a@ok.example"))
    [(block_id, status, _pending)] = second.replies()
    assert (block_id, status) == (b"m", qmqp.D)


# --- bad input ----------------------------------------------------------------------------------


def test_identifiable_bad_blocks_get_d_and_the_stream_goes_on(world: ListenerWorld) -> None:
    """No recipient, missing fields, unknown type: D with the reason; later blocks are served."""
    client = world.connect()
    client.send(
        encode_netstrings([b"M", b"norcpt", b"Subject: x\n\n", b"a@ok.example"])
        + encode_netstrings([b"M", b"short", b"Subject: x\n\n"])
        + encode_netstrings([b"X", b"strange", b"what"])
        + mail("fine", "a@ok.example")
    )
    assert client.received() == (
        reply("norcpt", b"Dmessage block has no recipient", 3)
        + reply("short", b"Dmessage block lacks a sender and a recipient", 2)
        + reply("strange", b"Dunknown block type 'X'", 1)
        + reply("fine", b"K", 0)
    )
    assert not client.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", kind="no-recipient") == 1
    assert world.sample("msggateway_protocol_errors_total", kind="missing-fields") == 1
    assert world.sample("msggateway_protocol_errors_total", kind="unknown-type") == 1


def test_refusal_descriptions_never_contain_hash(world: ListenerWorld) -> None:
    """A refusal quoting peer bytes escapes ``#`` (spec, "Result String": no ``#`` but HCMSSC)."""
    client = world.connect()
    client.send(encode_netstrings([b"#X", b"odd", b"what"]))
    [block] = client.blocks()
    assert isinstance(block, qmqp.ReplyBlock)
    assert (block.id, block.status) == (b"odd", qmqp.D)
    assert block.description.startswith(b"unknown block type")
    assert b"#" not in block.description


def test_too_large_block_is_d_without_being_delivered() -> None:
    """A block over ``max_message_bytes`` is skipped and answered D; the next is served."""
    world = ListenerWorld(settings=QMQPListenerSettings(max_message_bytes=200))
    client = world.connect()
    huge = mail("huge", "a@ok.example", body=b"x" * 500)
    client.send(huge[:100])
    client.send(huge[100:] + mail("fine", "a@ok.example"))
    [too_large, fine] = client.blocks()
    assert isinstance(too_large, qmqp.ReplyBlock)
    assert (too_large.id, too_large.status, too_large.pending) == (b"huge", qmqp.D, 1)
    assert b"over the 200-byte limit" in too_large.description
    assert fine == qmqp.ReplyBlock(id=b"fine", status=qmqp.K, description=b"", pending=0)
    assert len(world.answers.messages) == 1
    assert world.sample("msggateway_protocol_errors_total", kind="too-large") == 1


@pytest.mark.parametrize(
    ("garbage", "kind"),
    [
        (b"12x:1:M,", "missing-colon"),
        (b"0012:", "leading-zero"),
        (b"5:1:M,1:x;", "missing-comma"),
        (b"99999999999999999999:", "length-too-long"),
    ],
)
def test_unsynchronisable_input_closes_without_done_block(
    world: ListenerWorld, garbage: bytes, kind: str
) -> None:
    """Input that cannot be resynchronised: answered so far, then a close without done block."""
    client = world.connect()
    with capturedLogs() as events:
        client.send(mail("before", "a@ok.example") + garbage)
    assert client.received() == reply("before", b"K", 0)
    assert client.transport.disconnecting
    assert any("bad input" in event.get("log_format", "") for event in events)
    assert world.sample("msggateway_protocol_errors_total", kind=kind) == 1


def test_unsynchronisable_input_answers_outstanding_first(world: ListenerWorld) -> None:
    """Outstanding messages are answered before the close; no done block, nothing more read."""
    client = world.connect()
    client.send(mail("m1", "a@held.example") + mail("m2", "a@ok.example") + b"12x:")
    assert client.replies() == [(b"m2", qmqp.K, 1)]
    assert not client.transport.disconnecting
    assert client.transport.producerState == "paused"
    client.send(mail("ignored", "a@ok.example"))  # the codec is dead; nothing is read
    assert client.received() == b""

    world.held.outcomes[0].callback(Outcome.accepted())
    assert client.received() == reply("m1", b"K", 0)  # and no done block
    assert client.transport.disconnecting
    assert len(world.answers.messages) == 1
    assert world.sample("msggateway_protocol_errors_total", kind="missing-colon") == 1


def test_bad_input_on_one_connection_leaves_others_alone(world: ListenerWorld) -> None:
    """A connection closed for garbage does not disturb another one."""
    good = world.connect()
    good.send(mail("m1", "a@held.example"))
    bad = world.connect()
    bad.send(b"0012:")
    assert bad.transport.disconnecting
    bad.lose()
    good.send(CLIENT_SESSION)
    assert good.replies() == [(b"msg1", qmqp.K, 2), (b"msg2", qmqp.K, 1)]
    assert not good.transport.disconnecting
    world.held.outcomes[0].callback(Outcome.accepted())
    assert good.received() == reply("m1", b"K", 0) + DONE
    assert good.transport.disconnecting


# --- flow control ---------------------------------------------------------------------------------


def test_reading_pauses_at_max_in_flight_and_resumes_at_three_quarters() -> None:
    """At ``max_in_flight`` messages awaiting outcomes reading stops; it resumes at 3/4."""
    world = ListenerWorld(settings=QMQPListenerSettings(max_in_flight=8))
    client = world.connect()
    for i in range(7):
        client.send(mail(f"m{i}", "a@held.example"))
    assert client.transport.producerState == "producing"
    client.send(mail("m7", "a@held.example"))
    assert client.transport.producerState == "paused"

    world.held.outcomes[0].callback(Outcome.accepted())  # 7 in flight
    assert client.transport.producerState == "paused"
    world.held.outcomes[1].callback(Outcome.accepted())  # 6 = 3/4 of 8
    assert client.transport.producerState == "producing"
    world.clock.advance(0)
    assert [block_id for block_id, _, _ in client.replies()] == [b"m0", b"m1"]


def test_answered_at_once_messages_do_not_count_as_in_flight() -> None:
    """Messages answered at once (K, D, refusals) never fill the in-flight window."""
    world = ListenerWorld(settings=QMQPListenerSettings(max_in_flight=2))
    client = world.connect()
    client.send(b"".join(mail(f"m{i}", "a@ok.example") for i in range(5)))
    client.send(mail("x", "nobody@nowhere.example"))
    assert client.transport.producerState == "producing"
    assert len(client.replies()) == 6


def test_reading_pauses_at_max_in_flight_bytes() -> None:
    """Message bytes awaiting outcomes count too; reading resumes at 3/4 of the byte limit."""
    world = ListenerWorld(
        settings=QMQPListenerSettings(max_in_flight_bytes=4 * len(BODY), max_in_flight=1000)
    )
    client = world.connect()
    client.send(mail("m0", "a@held.example") + mail("m1", "a@held.example"))
    client.send(mail("m2", "a@held.example"))
    assert client.transport.producerState == "producing"
    client.send(mail("m3", "a@held.example"))
    assert client.transport.producerState == "paused"
    world.held.outcomes[3].callback(Outcome.accepted())  # 3 bodies = 3/4 of the limit
    assert client.transport.producerState == "producing"


def test_client_not_reading_replies_pauses_reading(world: ListenerWorld) -> None:
    """When the transport pauses us (replies pile up), reading stops until it resumes us."""
    client = world.connect()
    client.protocol.pauseProducing()  # as the transport does when its buffer is full
    assert client.transport.producerState == "paused"
    client.protocol.resumeProducing()
    assert client.transport.producerState == "producing"


def test_completions_do_not_resume_a_congested_connection() -> None:
    """Reading stays paused while the client does not read, even when outcomes complete."""
    world = ListenerWorld(settings=QMQPListenerSettings(max_in_flight=2))
    client = world.connect()
    client.send(mail("m0", "a@held.example") + mail("m1", "a@held.example"))
    assert client.transport.producerState == "paused"
    client.protocol.pauseProducing()
    world.held.outcomes[0].callback(Outcome.accepted())
    world.held.outcomes[1].callback(Outcome.accepted())
    assert client.transport.producerState == "paused"
    world.clock.advance(0)
    assert len(client.replies()) == 2  # replies are still written (the transport buffers)
    client.protocol.resumeProducing()
    assert client.transport.producerState == "producing"


def test_resume_from_transport_waits_for_in_flight_limit() -> None:
    """The transport resuming us does not resume reading while in-flight work is at its limit."""
    world = ListenerWorld(settings=QMQPListenerSettings(max_in_flight=2))
    client = world.connect()
    client.send(mail("m0", "a@held.example"))
    client.send(mail("m1", "a@held.example"))
    client.protocol.pauseProducing()
    client.protocol.resumeProducing()
    assert client.transport.producerState == "paused"
    world.held.outcomes[0].callback(Outcome.accepted())
    assert client.transport.producerState == "producing"


def test_done_block_is_not_resumed_by_the_transport(world: ListenerWorld) -> None:
    """After the done block reading stays stopped, whatever the transport says."""
    client = world.connect()
    client.send(mail("m", "a@held.example") + DONE)
    client.protocol.pauseProducing()
    client.protocol.resumeProducing()
    assert client.transport.producerState == "paused"


# --- metrics and connections --------------------------------------------------------------------


def test_metrics_count_replies_by_status_and_connections(world: ListenerWorld) -> None:
    """Replies are counted per status; connections are counted opened and open."""
    client = world.connect()
    client.send(
        mail("a", "a@ok.example")
        + mail("b", "b@ok.example")
        + mail("c", "c@busy.example")
        + mail("d", "d@bad.example")
        + mail("e", "e@nowhere.example")
    )
    assert world.sample("msggateway_qmqp_replies_total", status="K") == 2
    assert world.sample("msggateway_qmqp_replies_total", status="Z") == 1
    assert world.sample("msggateway_qmqp_replies_total", status="D") == 2
    assert world.sample("msggateway_connections", protocol="qmqp") == 1
    assert world.sample("msggateway_connections_opened_total", protocol="qmqp") == 1
    assert world.sample("msggateway_messages_received_total") == 5
    assert world.sample("msggateway_messages_sent_total") == 5
    client.lose()
    assert world.sample("msggateway_connections", protocol="qmqp") == 0
    assert world.factory.connections == set()


def test_factory_without_metrics_still_serves() -> None:
    """Metrics are optional: a factory without them answers the sample session the same."""
    world = ListenerWorld()
    plain = QMQPServerFactory(
        name=LISTENER,
        settings=SETTINGS,
        router=world.router,
        secrets=SECRETS,
        clock=world.clock,
    )
    protocol = plain.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
    protocol.dataReceived(CLIENT_SESSION)
    assert transport.value() == SERVER_SESSION


def test_a_half_sent_block_is_aborted_at_the_frame_time_out(world: ListenerWorld) -> None:
    """Half a block and nothing more: aborted 30 s later (before the idle time-out), counted."""
    client = world.connect()
    data = mail("half", "ops@ok.example")
    client.send(data[: len(data) // 2])
    world.clock.advance(29.9)
    assert not client.transport.disconnecting
    world.clock.advance(0.1)
    assert client.transport.disconnected
    assert world.sample("msggateway_protocol_errors_total", kind="frame-timeout") == 1
    assert world.sample("msggateway_protocol_errors_total", kind="idle-timeout") == 0


def test_a_half_sent_block_waits_while_the_listener_does_not_read() -> None:
    """Time spent not reading (the in-flight window is full) does not count against a block."""
    world = ListenerWorld(settings=QMQPListenerSettings(max_in_flight=1))
    client = world.connect()
    second = mail("m1", "ops@ok.example")
    client.send(mail("m0", "ops@held.example") + second[:10])
    assert client.transport.producerState == "paused"
    world.clock.advance(ROUTE_TIMEOUT_SECONDS)  # m0's route times out: Z, reading resumes
    assert client.transport.producerState == "producing"
    world.clock.advance(29.9)
    assert not client.transport.disconnecting
    world.clock.advance(0.1)
    assert client.transport.disconnected


def test_idle_and_byte_a_second_clients_are_closed() -> None:
    """No complete block in idle_timeout_seconds closes, even with a byte every second.

    A connection whose messages await outcomes is not idle.
    """
    world = ListenerWorld(attrs.evolve(SETTINGS, idle_timeout_seconds=ROUTE_TIMEOUT_SECONDS / 4))
    silent = world.connect()
    dribbling = world.connect()
    waiting = world.connect()
    waiting.send(mail("w", "ops@held.example"))
    data = mail("d", "ops@ok.example")
    # The held message's route times out at 10 s, after all of this.
    for second in range(3):
        dribbling.send(data[second : second + 1])
        world.clock.advance(0.4 if second == 2 else 1)
    assert not silent.transport.disconnecting and not dribbling.transport.disconnecting
    world.clock.advance(0.1)  # 2.5 s: the time-out itself, not the next periodic check
    assert silent.transport.disconnecting and dribbling.transport.disconnecting
    world.clock.advance(ROUTE_TIMEOUT_SECONDS / 4)
    assert not waiting.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", kind="idle-timeout") == 2


def test_the_idle_time_out_is_kept_to_the_second() -> None:
    """idle_timeout_seconds = 120: still open at 119.5 s, closed at 120 s, the log says 120."""
    world = ListenerWorld(attrs.evolve(SETTINGS, idle_timeout_seconds=120))
    client = world.connect()
    with capturedLogs() as events:
        world.clock.advance(119.5)
        assert not client.transport.disconnecting
        world.clock.advance(0.5)
    assert client.transport.disconnecting
    assert [event["seconds"] for event in events if "seconds" in event] == [120]


def test_the_idle_time_out_counts_from_the_last_block() -> None:
    """A block at 5 s moves the close to 125 s: not to the next check, 175 s."""
    world = ListenerWorld(attrs.evolve(SETTINGS, idle_timeout_seconds=120))
    client = world.connect()
    world.clock.advance(5)
    client.send(mail("m", "ops@ok.example"))
    assert client.replies() == [(b"m", b"K", 0)]
    with capturedLogs() as events:
        world.clock.advance(119.5)
        assert not client.transport.disconnecting
        world.clock.advance(0.5)
    assert client.transport.disconnecting
    assert [event["seconds"] for event in events if "seconds" in event] == [120]


def test_the_idle_time_out_counts_from_the_last_reply_owed() -> None:
    """Time a message awaits its outcome is not idle: the count starts at its reply.

    The held message is answered at 50 s, past the 20 s time-out: the
    connection is closed 20 s after that reply, not at once and not later.
    """
    routes = (attrs.evolve(ROUTES[-1], timeout_seconds=100),)
    world = ListenerWorld(attrs.evolve(SETTINGS, idle_timeout_seconds=20), routes=routes)
    client = world.connect()
    client.send(mail("h", "ops@held.example"))
    world.clock.advance(50)
    assert not client.transport.disconnecting
    world.held.outcomes[0].callback(Outcome.accepted())
    world.clock.advance(0)  # the reply's flush
    assert client.replies() == [(b"h", b"K", 0)]
    world.clock.advance(19.5)
    assert not client.transport.disconnecting
    world.clock.advance(0.5)
    assert client.transport.disconnecting


def test_replies_within_a_read_restart_a_stopped_idle_timer() -> None:
    """A read answered at once after the timer stopped for an outcome: still timed out."""
    routes = (attrs.evolve(ROUTES[-1], timeout_seconds=100), ROUTES[1])
    world = ListenerWorld(attrs.evolve(SETTINGS, idle_timeout_seconds=20), routes=routes)
    client = world.connect()
    client.send(mail("h", "ops@held.example"))
    world.clock.advance(30)  # the timer found a message owed and stopped
    world.held.outcomes[0].callback(Outcome.accepted())
    client.send(mail("k", "ops@ok.example"))  # answered within the read
    world.clock.advance(19.5)
    assert not client.transport.disconnecting
    world.clock.advance(0.5)
    assert client.transport.disconnecting
