"""The MTL server role: a control ROUTER socket and a data ROUTER socket.

Control (spec, "Control Flow"): sessions, SASL logins, profiles and data
leases are `gateway.protocols.mtl.control`'s; `MTLServer` hands it what its
control socket reads.

Data (spec, "Data Flow"): a DEALER peer sends Lease and gets Response
200/403; Summon and Dismiss get 200/400 in order; Content follows the
lease's profile; Confirm and Reject settle what the gateway sent; Ping is
answered Pong; the listener pings its peers every
``ping_interval_seconds``. Who the data peers are (each its connection's),
and when one is forgotten (its connection closed or taken over, silent for
``dead_after_seconds``, gone), is `gateway.protocols.mtl.peers`'s; how the
sockets are made and who may connect, `gateway.protocols.mtl.sockets`'s.
Ill-formed commands are dropped.

Batches (DESIGN.md, "The batch is the unit of work"): the gateway-profile
Contents of one ZeroMQ read burst (every message waiting when the reactor
woke, from every writer) go to the router as one batch, and each has its own
Confirm or Reject from its own outcome. A batch routed to the listener goes
out to its readers in one go, its outcomes gathered in one `PendingBatch`.

Profile ``test``: one resource, ``resource``; no confirmations (``full``
is ``501``); every writer's content goes to every reader that summoned it.

Profile ``gateway``: resources are addresses. A writer's content is routed
from the listener with its resource as the address (properties with text
values become headers, ``message-id`` the id); with ``confirm = "full"`` the
outcome comes back as Confirm (accepted), Reject (rejected) or Reject with
recycle (retry later). Routes deliver to the listener: a message goes to
every reader that summoned its address; readers with ``confirm = "full"``
answer for it (Confirm: accepted, Reject: rejected, Reject recycle: retry
later), readers without confirmations accept it once ZeroMQ took it; a
message answers the worst of its readers' answers, a reader found gone
meanwhile not counting; no reader left: retry later.

Slow readers (DESIGN.md, "Back-pressure before loss"; the listener's
``flow``): under ``pause-producers`` (the default) what ZeroMQ refuses for
a congested data peer waits for it, reading holds meanwhile, and a slow
consumer is cut, as `gateway.protocols.mtl.backlog` says (counted in
``msggateway_slow_consumer_disconnects`` and logged). Past
``max_in_flight`` routed Contents unanswered (a destination that answers
once its consumer drained, such as a congested reader of another MTL
listener or SSMP subscriber) the data socket is not read until half are.
Under ``disconnect`` nothing is held and nobody waits: a refused Content is
retry later for a route (a confirm=full writer gets Reject with recycle), a
refused test-profile copy is dropped, each counted (``not-sent``) and
logged at the next ping round. Under both, a confirm=full reader with
``max_backlog_messages`` Contents unconfirmed (it reads but does not
confirm) gets no more until it confirms: retry later, counted ``not-sent``
(its Confirms come on the data socket, which holding would stop reading).
"""

from __future__ import annotations

import functools
from typing import Any, Final, Unpack

from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from zope.interface import implementer

from gateway.codecs import mtl
from gateway.codecs.fieldtable import FieldValue
from gateway.codecs.mtl import confirm_fields, content_fields
from gateway.core.auth import DEFAULT_LOGIN_FAILURES, LoginFailurePolicy
from gateway.core.authorization import UNRESTRICTED, Action, Authorization, check
from gateway.core.flow import Congestion
from gateway.core.inbox import Inbox
from gateway.core.interfaces import IDestination
from gateway.core.message import Outcome
from gateway.protocols.listener import DEFAULT_LISTEN_BACKLOG
from gateway.protocols.logins import LoginRefusals
from gateway.protocols.mtl.backlog import Backlogs
from gateway.protocols.mtl.confirms import WriterReplies
from gateway.protocols.mtl.control import ControlFlow
from gateway.protocols.mtl.delivery import ReaderDelivery
from gateway.protocols.mtl.mapping import message_from_content, settle, settle_confirm
from gateway.protocols.mtl.peer import MTLPeerArgs
from gateway.protocols.mtl.peers import DataPeer, DataPeers
from gateway.protocols.mtl.settings import MTLListenerSettings
from gateway.protocols.mtl.sockets import ListenerSockets

__all__ = ["MTLServer"]

_ACCEPTED: Final = Outcome.accepted()


@implementer(IDestination)
class MTLServer(ReaderDelivery):
    """One MTL listener: its two sockets, sessions, leases and data peers.

    Built with `MTLPeerArgs`: both sockets bind to ``host``, the control
    socket to ``port`` (0: the OS picks); writers' content (gateway profile)
    goes to ``router``; ``secrets`` check PLAIN and SCRAM logins.
    """

    _log = Logger()

    login_failures: LoginFailurePolicy = DEFAULT_LOGIN_FAILURES
    """How refused logins are slowed down and cut off; the assembly sets the listener's."""

    @functools.cached_property
    def logins(self) -> LoginRefusals:
        """Its refused logins: waits, counter and log (made at first use)."""
        return LoginRefusals(self.name, self.login_failures, self.clock, self._metrics)

    def __init__(self, **args: Unpack[MTLPeerArgs[MTLListenerSettings]]) -> None:
        super().__init__(**args)
        name, router = self.name, self.router
        self.data_port = 0
        self.control = ControlFlow(self)
        """Sessions, logins, profiles and the leases they were granted."""
        self._sockets: ListenerSockets | None = None
        """Its sockets, the ZAP handler and the watches of their connections, once started."""
        self._timer: IDelayedCall | None = None
        self.authorization: Authorization = UNRESTRICTED
        """Who may write and read which resources; the assembly sets it from ``authorize``."""
        self.backlog = DEFAULT_LISTEN_BACKLOG
        """Connections the kernel holds for each socket before ZeroMQ accepts them (ZMQ_BACKLOG)."""
        self._reader_who = f"an MTL reader of {name}"
        self._not_reading = Outcome.retry(f"an MTL reader of {name} is not reading")
        self._not_confirming = Outcome.retry(
            f"an MTL reader of {name} has {self.settings.max_backlog_messages} Contents"
            " unconfirmed (max_backlog_messages)"
        )
        # Back-pressure: the data socket is read while no congested peer holds it, nor
        # too many routed Contents wait for their answers (`_answers_due`).
        self._backlogs: Backlogs[DataPeer] = Backlogs(
            self.clock,
            lambda: self.flow,
            lambda: self._data.pause_reading(),
            self._resume_reading,
            lambda messages: self._data.send_in_order(messages),
            lambda peer: self.peers.gone((peer,)),
            self._slow_consumer,
        )
        self.peers = DataPeers(
            name,
            self.clock,
            self._backlogs,
            lambda: self.settings.dead_after_seconds,
            self.count_error,
        )
        """The data peers: their connections, and when they are forgotten."""
        self._peers = self.peers.by_identity
        self._in_flight = 0
        self._burst_time = 0.0
        """When the data socket's read burst being handled began (`_heard`)."""
        self._burst_peer: DataPeer | None = None
        """The peer of the burst's last well-formed command (`_heard`)."""
        self._answers_due = Congestion()
        # Each routed Content's writer and sequence when its writer wants a confirmation.
        replies = WriterReplies(self._peers, self._send, self._answered, self.count_error)
        self._inbox: Inbox[tuple[DataPeer, int] | None] = Inbox(
            router, name, replies.one, replies.batch
        )

    # --- life --------------------------------------------------------------------------

    def start(self) -> int:
        """Bind both sockets; return the control port bound."""
        import zmq

        from gateway.protocols.mtl.sockets import listener_sockets
        from gateway.protocols.mtl.zmq import zmq_factory

        settings = self.settings
        self._zmq = zmq_factory(self._reactor)
        sockets = listener_sockets(
            self._zmq,
            listener=self.name,
            settings=settings,
            backlog=self.backlog,
            clock=self.clock,
            control=(self._on_control, self.control.closed),
            data=(self._on_data, self._drained, self.peers.closed),
            count_error=self.count_error,
        )
        self._sockets = sockets
        self._control, self._data = sockets.control, sockets.data
        self.peers.look_first = sockets.look_at_connections
        if settings.curve_secret_key is not None:
            self._log.info(
                "MTL listener {listener}: CURVE on, server public key {public_key}",
                listener=self.name,
                public_key=zmq.curve_public(settings.curve_secret_key).decode("ascii"),
            )
        bound = self._control.bind(f"tcp://{self.host}:{self.port or '*'}")
        self.port = int(bound.rsplit(":", 1)[1])
        bound = self._data.bind(f"tcp://{self.host}:{settings.data_port or '*'}")
        self.data_port = int(bound.rsplit(":", 1)[1])
        if settings.ping_interval_seconds > 0:
            self._timer = self.clock.callLater(settings.ping_interval_seconds, self._tick)
        return self.port

    def stop(self) -> None:
        """Close the sockets; what waits for a confirmation is retried elsewhere."""
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        self._backlogs.stop()
        self.peers.stop()
        self._outbox.flush()
        self._sockets = None
        if self._zmq is not None:
            self._zmq.shutdown()
            self._zmq = None

    # --- control flow ------------------------------------------------------------------

    def _on_control(self, frames: list[bytes]) -> None:
        self.control.receive(frames)

    @property
    def control_socket(self) -> Any:
        """The control ROUTER socket (`ControlHost`)."""
        return self._control

    @property
    def running(self) -> bool:
        """Whether the sockets are open (`ControlHost`)."""
        return self._zmq is not None

    # --- data flow ---------------------------------------------------------------------

    def _on_data(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        identity = frames[0]
        if len(frames) == 3:  # a reader's Confirm or a writer's Content: not built
            header = frames[1]
            confirmed = confirm_fields(header)
            if confirmed is not None:
                sequence, multiple = confirmed
                unconfirmed = self._heard(identity).unconfirmed
                if multiple:
                    settle_confirm(unconfirmed, sequence, True)
                else:  # one Content's Confirm: a reader's usual answer
                    entry = unconfirmed.pop(sequence, None)
                    if entry is not None:
                        entry[0].settle(entry[1], _ACCEPTED)
                return
            content = content_fields(header)
            if content is not None:
                self._content(self._heard(identity), *content, frames[2])
                return
        try:
            command = mtl.decode_data(frames[1:])
        except mtl.MTLError:
            self.count_error("ill-formed-data")
            known = self._peers.get(identity)
            if known is not None:  # it may have been a Content: its number is unknown
                known.answers.lapse()
            return  # the spec: drop it silently
        peer = self._heard(identity)
        # The commands of the data path first: they are nearly all there is.
        if isinstance(command, mtl.Content):
            self._content(
                peer, command.sequence, command.resource, command.properties, command.body
            )
        elif isinstance(command, mtl.Confirm | mtl.Reject):
            settle(peer.unconfirmed, command, self._reader_who)
        elif isinstance(command, mtl.Lease):
            peer.answers.numbered(command.sequence)
            lease = self.control.lease(command.lease)
            if lease is not None:
                peer.lease = lease
            self._send(peer, mtl.Response(command.sequence, 200 if lease else 403))
        elif isinstance(command, mtl.Summon | mtl.Dismiss):
            peer.answers.numbered(command.sequence)
            self._summon(peer, command)
        elif isinstance(command, mtl.Ping):
            self._send(peer, mtl.Pong())
        # Pong and stray Responses: being heard is all.

    def _heard(self, identity: bytes) -> DataPeer:
        """The peer a well-formed data command came from, heard now; counted.

        A read burst's first command notes the time, which its others
        share (the peers' last hearing and the messages' arrival), and
        holds the answers until the burst is drained.
        """
        self.traffic.messages_in += 1
        outbox = self._outbox
        if not outbox.reading:
            outbox.reading = True  # answers go out when the burst is drained
            self._burst_time = self.clock.seconds()
            self._burst_peer = None
        data = self._data
        connection = getattr(data, "connection", None)
        peer = self._burst_peer
        if (
            peer is not None
            and peer.identity == identity
            and peer.connection == connection
            and not peer.forgotten
        ):  # heard already in this burst, at its time
            return peer
        peer = self._burst_peer = self.peers.heard(
            identity, connection, getattr(data, "source_fd", None), self._burst_time
        )
        return peer

    def _drained(self) -> None:
        """The data socket's read burst is over: route its Contents, send its answers.

        Past ``max_in_flight`` Contents routed and unanswered, the data socket
        is not read until half of them are (a route's destination that
        answers once its consumers drained thereby slows these writers).
        """
        count = len(self._inbox)
        if count:
            self._in_flight += count
            self._inbox.dispatch()
            due = self._answers_due
            if self._in_flight >= self.settings.max_in_flight and not due.congested:
                due.begin()
                due.hold(self._backlogs.reading)
        self._outbox.reading = False
        self._outbox.flush()

    def _summon(self, peer: DataPeer, command: mtl.Summon | mtl.Dismiss) -> None:
        lease = peer.lease
        code = peer.summon(
            command,
            lambda: (
                not self.authorization.restricted
                or self._authorized(
                    Action.CONSUME, lease.identity if lease else None, command.resource
                )
            ),
        )
        self._send(peer, mtl.Response(command.sequence, code))

    def _content(
        self,
        peer: DataPeer,
        sequence: int,
        resource: str,
        properties: dict[str, FieldValue],
        body: bytes,
    ) -> None:
        """A Content, by its fields (the hot path does not build the command)."""
        lease = peer.lease
        if lease is None or lease.kind != "writer":
            self.count_error("content-without-writer-lease")
            self._reject_at_once(peer, sequence)
            return
        if not resource and len(lease.resources) == 1:
            resource = lease.resources[0]
        if not resource or (lease.resources and resource not in lease.resources):
            # Invalid but well-formed: answered (spec, "Data Flow Error Handling"),
            # with a Reject even on a flow without confirmations.
            self.count_error("bad-resource")
            self._reject_at_once(peer, sequence)
            return
        if (
            self.authorization.restricted
            and not lease.resources
            and not self._authorized(Action.PUBLISH, lease.identity, resource)
        ):  # a lease for "any and all" resources: checked content by content
            self._reject_at_once(peer, sequence)
            return
        if lease.profile == "test":
            for reader in self.peers.readers(resource, "test"):
                self._send(reader, mtl.Content(next(reader.sequence), resource, properties, body))
            return
        message = message_from_content(resource, properties, body, self._burst_time)
        # Routed with the rest of the read burst (`_inbox.dispatch` once it is drained).
        if lease.confirm == "full":
            peer.answers.routed(sequence)
            self._inbox.add(message, (peer, sequence))
        else:
            self._inbox.add(message, None)

    def _reject_at_once(self, peer: DataPeer, sequence: int) -> None:
        """Reject a Content on the spot; its writer's Contents are confirmed one by one after."""
        peer.answers.lapse()
        self._send(peer, mtl.Reject(sequence, False, False))

    def _answered(self, count: int) -> None:
        """``count`` routed Contents have their outcomes: writers held for them may go on."""
        self._in_flight -= count
        due = self._answers_due
        if due.congested and self._in_flight <= self.settings.max_in_flight // 2:
            due.drained()

    # --- back-pressure -----------------------------------------------------------------

    def _slow_consumer(self, peer: DataPeer, why: str) -> None:
        """Forget a congested peer given up on (stuck, or past the cap), counted and logged."""
        self._log.warn(
            "MTL listener {listener}: forgot a slow consumer, a data peer that does not"
            " read what is sent to it: {why}",
            listener=self.name,
            why=why,
        )
        if self._metrics is not None:
            self._metrics.slow_consumers.labels(self.name).inc()
        self.peers.forget(peer, "a slow consumer")

    # --- heartbeats --------------------------------------------------------------------

    def _tick(self) -> None:
        """Ping every data peer; say what was not sent since the last round."""
        if self.not_sent:
            self._log.warn(
                "MTL listener {listener}: {count} data command(s) not sent in the last"
                " {seconds:g} s: their peers do not read or confirm ({limit} waiting:"
                " max_backlog_messages) or are gone",
                listener=self.name,
                count=self.not_sent,
                seconds=self.settings.ping_interval_seconds,
                limit=self.settings.max_backlog_messages,
            )
            self.not_sent = 0
        for peer in list(self._peers.values()):
            self._send(peer, mtl.Ping())
        self._outbox.flush()
        self._timer = self.clock.callLater(self.settings.ping_interval_seconds, self._tick)

    def _resume_reading(self) -> None:
        """Read the data socket again; look for dead peers if a deadline came meanwhile."""
        self._data.resume_reading()
        self.peers.reading_resumed()

    # --- helpers -----------------------------------------------------------------------

    def _send(self, peer: DataPeer, command: mtl.DataCommand) -> None:
        """Send a data command with the others of this burst or reactor turn (`Outbox`).

        A congested peer's goes after what it holds, in order; a departed
        peer's is dropped (ZeroMQ has no connection to send it on).
        """
        if peer.departed:
            return
        self.traffic.messages_out += 1
        frames = [peer.identity, *mtl.encode_data(command)]
        backlog = peer.backlog
        if backlog:
            self._backlogs.hold(peer, backlog, frames)
            self._backlogs.check(peer, backlog)
        elif type(command) is mtl.Confirm and command.multiple:
            # Several route batches answered in one turn: the last Confirm covers them all.
            self._outbox.add_latest(frames)
        else:
            self._outbox.add(frames)

    def _send_out(self, messages: list[list[bytes]]) -> None:
        """Send what the outbox gathered: hold what a congested peer's queue refused."""
        data = self._data
        if data is None:
            return
        full, gone = data.send_routed(messages)
        if gone:
            self._count_not_sent(len(gone))
            peers = self._peers
            self.peers.gone(
                peer
                for peer in (peers.get(messages[position][0]) for position in gone)
                if peer is not None
            )
        if not full:
            return
        if not self.flow.pauses_producers:
            self._count_not_sent(len(full))  # dropped, as ZeroMQ would drop it
            return
        grown: dict[DataPeer, None] = {}
        for position in full:
            frames = messages[position]
            peer = self._peers.get(frames[0])
            if peer is None:
                self._count_not_sent(1)
                continue
            self._backlogs.hold(peer, peer.backlog, frames)
            grown[peer] = None
        for peer in grown:
            self._backlogs.check(peer, peer.backlog)

    def _authorized(self, action: Action, identity: str | None, resource: str) -> bool:
        return check(
            self.authorization,
            action,
            identity,
            resource,
            listener=self.name,
            count_error=self.count_error,
        )
