"""An MTL listener's data peers: which connection each is, and when each is forgotten.

A data peer (a DEALER socket, spec "Data Flow") is known by its ZeroMQ
routing id, which the peer may choose, and is its connection's: the
listener's ZAP handler numbers every connection and libzmq attaches the
number to each message (`ZmqSocket.connection`). A message under a known
routing id from another connection means the first is gone: its peer is
forgotten, and the new connection starts a peer without a lease.

When ZeroMQ says a peer's connection closed (`DataPeers.closed`, from
libzmq's socket monitor), or refuses a send to it for want of a connection
(`DataPeers.gone`, ``EHOSTUNREACH``), the peer has *departed*: nothing is
sent to it any more, it reads nothing (its summons go, what waits for it is
retry later), but its lease still covers what it sent before it left. A
writer that sends its last Contents and closes its socket leaves them
queued here, unread while back-pressure holds the data socket; they are
still its, and routed as such. A departed peer is forgotten once silent.

A peer is forgotten:

* when its silence reaches ``dead_after_seconds``: one timer for all peers,
  armed for the earliest deadline, looks again at each; time the data
  socket was not read (`Backlogs.listened`) is the listener's silence, not
  the peer's, and a deadline that comes while it is not read is looked at
  again once it is (`DataPeers.reading_resumed`);
* when the listener gives up on it as a slow consumer, or stops.

Forgetting drops its lease and summons; what waits for it (its backlog, the
Contents it left unconfirmed) is retry later.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.codecs import mtl
from gateway.core.message import Outcome
from gateway.protocols.mtl.backlog import Backlog, Backlogs
from gateway.protocols.mtl.confirms import WriterAnswers
from gateway.protocols.mtl.control import DataLease
from gateway.protocols.mtl.mapping import Unconfirmed, give_back

__all__ = ["DataPeer", "DataPeers"]

_CLOCK_SLACK_SECONDS: Final = 1e-6
"""A deadline computed in floating point counts as reached this close to it."""


@attrs.define(eq=False)
class DataPeer:
    """One data peer (a DEALER socket) and what it holds."""

    identity: bytes
    connection: str | None = None
    """The connection it came on (the ZAP handler's number; None: not known)."""
    fd: int | None = None
    """That connection's file descriptor, by which ZeroMQ says it closed."""
    lease: DataLease | None = None
    summoned: set[str] = attrs.Factory(set)
    heard: float = 0.0
    """When it was last heard from, in the data socket's listening time (`Backlogs.listened`)."""
    sequence: Any = attrs.Factory(lambda: itertools.count(1))
    unconfirmed: Unconfirmed = attrs.Factory(dict)
    backlog: Backlog = attrs.Factory(Backlog)
    """What ZeroMQ refused for it (its queue full), in order, offered again until taken."""
    forgotten: bool = False
    departed: bool = False
    """Its connection is gone: nothing is sent to it; its lease covers what it sent before."""
    answers: WriterAnswers = attrs.Factory(WriterAnswers)
    """As a confirm=full writer: what it was answered, and when one Confirm may cover several."""

    def summon(self, command: mtl.Summon | mtl.Dismiss, authorized: Callable[[], bool]) -> int:
        """Take a Summon or Dismiss; the Response's code (200, 400 or 403).

        403 without a lease; 400 for what its reader lease does not cover,
        a resource summoned twice or dismissed unsummoned. ``authorized``
        says whether the listener's authorization lets it consume the
        resource: asked of a Summon under a lease for "any and all"
        resources, whose resources are checked one by one.
        """
        lease = self.lease
        if lease is None:
            return 403
        allowed = lease.kind == "reader" and (
            not lease.resources or command.resource in lease.resources
        )
        if isinstance(command, mtl.Dismiss):
            ok = command.resource in self.summoned
            self.summoned.discard(command.resource)
            return 200 if ok else 400
        if allowed and not lease.resources and not authorized():
            return 403
        ok = allowed and command.resource not in self.summoned
        if ok:
            self.summoned.add(command.resource)
        return 200 if ok else 400


class DataPeers:
    """The data peers of one listener, by routing id.

    Args:
        listener: The listener's name, for the log and the outcomes' reasons.
        clock: The listener's clock.
        backlogs: The data socket's backlogs (and its listening time).
        dead_after: ``dead_after_seconds`` now.
        count_error: Counts a protocol error of some kind.

    Attributes:
        by_identity: Each peer by its routing id.
    """

    _log = Logger()
    look_first: Callable[[], None] | None = None
    """Takes in the connections that closed (`ListenerSockets.look_at_connections`), if set."""

    def __init__(
        self,
        listener: str,
        clock: IReactorTime,
        backlogs: Backlogs[DataPeer],
        dead_after: Callable[[], float],
        count_error: Callable[[str], None],
    ) -> None:
        self._listener = listener
        self._clock = clock
        self._backlogs = backlogs
        self._dead_after = dead_after
        self._count_error = count_error
        self.by_identity: dict[bytes, DataPeer] = {}
        self._by_fd: dict[int, DataPeer] = {}
        self._reaper: IDelayedCall | None = None
        """The next look for peers silent for ``dead_after_seconds`` (`_reap`)."""
        self._reap_on_resume = False
        """The reaper came while the data socket was not read: look again once it is."""

    def heard(
        self, identity: bytes, connection: str | None, source_fd: Any, now: float
    ) -> DataPeer:
        """The peer a message under ``identity`` came from, on ``connection``; heard at ``now``.

        Args:
            identity: Its routing id.
            connection: Its connection's number (None: not known).
            source_fd: Gives the connection's file descriptor (or None), for a new peer.
            now: When it was read (the clock's time of its read burst).
        """
        peer = self.by_identity.get(identity)
        if peer is None or peer.connection != connection:
            if self.look_first is not None:
                # A connection that closed is known first: its routing id, or its file
                # descriptor reused, is not taken for this connection's.
                self.look_first()
                peer = self.by_identity.get(identity)
            if peer is not None:
                self._taken(peer)
            peer = self._new(identity, connection, source_fd)
        peer.heard = now - self._backlogs.deaf_seconds
        return peer

    def readers(self, resource: str, profile: str) -> list[DataPeer]:
        """The peers with a reader lease of ``profile`` that summoned ``resource``."""
        return [
            peer
            for peer in self.by_identity.values()
            if peer.lease is not None
            and peer.lease.profile == profile
            and peer.lease.kind == "reader"
            and resource in peer.summoned
        ]

    def closed(self, fd: int) -> None:
        """ZeroMQ says the data connection with file descriptor ``fd`` closed: forget its peer."""
        peer = self._by_fd.pop(fd, None)
        if peer is not None:
            self.gone((peer,))

    def gone(self, peers: Iterable[DataPeer]) -> None:
        """Peers ZeroMQ has no connection with any more (they left without a word) departed.

        Nothing more is sent to them, they read nothing more (what waits for
        them is retry later), but what they sent before they left and is
        still to be read here is theirs: their lease stays until they are
        forgotten for their silence.
        """
        for peer in peers:
            if not peer.forgotten and not peer.departed:
                self._count_error("gone-peer")
                self._log.info(
                    "MTL listener {listener}: a data peer is gone (ZeroMQ has no connection"
                    " with it any more): nothing more is sent to it",
                    listener=self._listener,
                )
                peer.departed = True
                peer.summoned.clear()
                if peer.fd is not None and self._by_fd.get(peer.fd) is peer:
                    del self._by_fd[peer.fd]
                self._give_back(peer, "its connection is gone")

    def forget(self, peer: DataPeer, why: str) -> None:
        """Drop a peer: its lease and summons go, what waits on it is retry later."""
        if self.by_identity.get(peer.identity) is peer:
            del self.by_identity[peer.identity]
        if peer.fd is not None and self._by_fd.get(peer.fd) is peer:
            del self._by_fd[peer.fd]
        peer.forgotten = True
        self._give_back(peer, why)

    def _give_back(self, peer: DataPeer, why: str) -> None:
        """What waits for a peer that went away is retry later."""
        gone = Outcome.retry(f"an MTL reader of {self._listener} went away ({why})")
        self._backlogs.forget(peer, peer.backlog, gone)
        give_back(peer.unconfirmed, gone)

    def reading_resumed(self) -> None:
        """The data socket is read again: look for dead peers if a deadline came meanwhile."""
        if self._reap_on_resume:
            self._reap_on_resume = False
            self._reap()

    def stop(self) -> None:
        """Forget every peer (the listener is stopping); look for dead ones no more."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.active():
            reaper.cancel()
        self._reap_on_resume = False
        for peer in list(self.by_identity.values()):
            self.forget(peer, "the listener is stopping")

    def _new(self, identity: bytes, connection: str | None, source_fd: Any) -> DataPeer:
        """A data peer heard from for the first time (on this connection)."""
        peer = self.by_identity[identity] = DataPeer(identity, connection)
        if source_fd is not None:
            peer.fd = source_fd()
            if peer.fd is not None:
                self._by_fd[peer.fd] = peer
        if self._reaper is None and not self._reap_on_resume:
            self._reaper = self._clock.callLater(self._dead_after(), self._reap)
        return peer

    def _taken(self, peer: DataPeer) -> None:
        """Another connection took a peer's routing id: forget the old one's peer."""
        self._count_error("gone-peer")
        self._log.info(
            "MTL listener {listener}: data routing id {routing_id!r} now comes from another"
            " connection: forgot the data peer of the old one (its lease is not inherited)",
            listener=self._listener,
            routing_id=peer.identity,
        )
        self.forget(peer, "its connection is gone")

    def _reap(self) -> None:
        """Forget the peers silent for ``dead_after_seconds``; come back at the next deadline.

        One timer for all peers, armed for the earliest deadline (the least
        recently heard peer's): a peer is forgotten when its silence reaches
        the limit, not at the next ping round. Silence while the data socket
        was not read is ours, not the peer's: a deadline that comes while
        reading is held is looked at again once reading resumes.
        """
        self._reaper = None
        backlogs = self._backlogs
        if backlogs.deaf:
            self._reap_on_resume = True
            return
        now = backlogs.listened(self._clock.seconds())
        limit = self._dead_after()
        oldest: float | None = None
        for peer in list(self.by_identity.values()):
            silent = now - peer.heard
            if silent >= limit - _CLOCK_SLACK_SECONDS:
                self._count_error("dead-peer")
                why = f"silent for {silent:.1f} s"
                self._log.info(
                    "MTL listener {listener}: forgot a dead data peer ({why})",
                    listener=self._listener,
                    why=why,
                )
                self.forget(peer, why)
            elif oldest is None or peer.heard < oldest:
                oldest = peer.heard
        if oldest is not None:
            self._reaper = self._clock.callLater(oldest + limit - now, self._reap)
