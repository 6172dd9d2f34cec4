"""An MTL listener as a route's destination: a batch to its gateway-profile readers.

`ReaderDelivery` is the part of `gateway.protocols.mtl.server.MTLServer`
that routes deliver to (spec, "Data Flow"; the server's docstring says
what each reader's answer means): a message goes as a Content to every
reader that summoned its address, all of a batch's Contents in one send,
their outcomes gathered in one `PendingBatch`. What ZeroMQ refuses for a
congested reader waits for it under ``pause-producers`` and is retry later
under ``disconnect``; a reader found gone is withdrawn from its messages'
answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.defer import Deferred

from gateway.codecs import mtl
from gateway.codecs.mtl import content_header_with_id
from gateway.core.flow import DEFAULT_FLOW, FlowPolicy
from gateway.core.message import Message, Outcome
from gateway.protocols.mtl.backlog import Backlogs
from gateway.protocols.mtl.mapping import Copy, PendingBatch, content_properties
from gateway.protocols.mtl.peer import MTLPeer
from gateway.protocols.mtl.peers import DataPeer, DataPeers
from gateway.protocols.mtl.settings import MTLListenerSettings

__all__ = ["ReaderDelivery"]


class ReaderDelivery(MTLPeer[MTLListenerSettings]):
    """`deliver`: a routed batch to the readers of its addresses, in one send."""

    flow: FlowPolicy = DEFAULT_FLOW
    """How a reader slower than its writers is treated; the assembly sets the listener's."""
    peers: DataPeers
    _backlogs: Backlogs[DataPeer]
    _not_confirming: Outcome
    _not_reading: Outcome

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Send a batch to the gateway-profile readers that summoned each message's address.

        All of the batch's Contents go out together. A confirm=full reader's
        Confirm or Reject answers its copy; a reader without confirmations
        accepts its copy once ZeroMQ took it; a message goes to every reader
        of its address and answers the worst of their answers. A reader
        ZeroMQ no longer has a connection with is forgotten and its copy
        does not count. No reader, or a confirm=full reader with
        ``max_backlog_messages`` Contents unconfirmed: retry later. A copy
        ZeroMQ refuses because the reader's queue is full waits for it under
        the ``pause-producers`` policy (`_hold`), and is retry later under
        ``disconnect``.
        """
        batch = PendingBatch(len(messages))
        # What readers were told before goes first; a reader that congests meanwhile
        # holds what follows.
        self._outbox.flush()
        # Per address, its readers: each, whether it confirms, whether it holds a backlog
        # (neither changes while the batch is encoded), and (shared by its addresses)
        # how many more Contents it may have unconfirmed.
        readers_of: dict[str, list[tuple[DataPeer, bool, bool, list[int]]]] = {}
        rooms: dict[DataPeer, list[int]] = {}
        frames: list[list[bytes]] = []
        targets: list[DataPeer] = []
        copies: list[Copy] = []
        waiting: list[tuple[DataPeer, list[bytes], Copy]] = []  # for congested readers
        limit = self.settings.max_backlog_messages
        held_back = 0
        last_address = None
        readers: list[tuple[DataPeer, bool, bool, list[int]]] = []
        for index, message in enumerate(messages):
            address = message.address
            if address != last_address:
                last_address = address
                found = readers_of.get(address)
                if found is None:
                    found = readers_of[address] = [
                        (
                            reader,
                            reader.lease is not None and reader.lease.confirm == "full",
                            bool(reader.backlog),
                            rooms.setdefault(reader, [limit - len(reader.unconfirmed)]),
                        )
                        for reader in self.peers.readers(address, "gateway")
                    ]
                readers = found
            if not readers:
                batch.settle(
                    index, Outcome.retry(f"no MTL reader of {self.name} summoned {address!r}")
                )
                continue
            if len(readers) > 1:
                batch.copies(index, len(readers))
            # The common case, the id alone: its table written without a dict.
            properties = content_properties(message) if message.headers or message.sender else None
            body = message.body
            for reader, confirms, held, room in readers:
                if confirms:
                    # A reader that reads but does not confirm holds what it read here.
                    # Past the limit: retry later, not held (holding would stop reading
                    # the data socket, which its Confirms come on).
                    if room[0] <= 0:
                        batch.settle(index, self._not_confirming)
                        held_back += 1
                        continue
                    room[0] -= 1
                sequence = next(reader.sequence)
                try:
                    if properties is None:
                        header = content_header_with_id(sequence, address, message.id)
                        routed = [reader.identity, header, body]
                    else:
                        encoded = mtl.encode_content(sequence, address, properties, body)
                        routed = [reader.identity, *encoded]
                except mtl.MTLLocalError as exc:
                    batch.settle(index, Outcome.rejected(f"MTL cannot carry it: {exc.reason}"))
                    continue
                copy = (reader.unconfirmed if confirms else None, sequence, index)
                if held:
                    waiting.append((reader, routed, copy))
                else:
                    frames.append(routed)
                    targets.append(reader)
                    copies.append(copy)
        if held_back:
            self._count_not_sent(held_back)
        if frames or waiting:
            self.traffic.messages_out += len(frames) + len(waiting)
            self._send_contents(batch, frames, targets, copies, waiting)
        return batch.deferred

    def _send_contents(
        self,
        batch: PendingBatch,
        frames: list[list[bytes]],
        targets: list[DataPeer],
        copies: list[Copy],
        waiting: list[tuple[DataPeer, list[bytes], Copy]],
    ) -> None:
        """Send a batch's Contents in one go; hold, withdraw or answer what ZeroMQ refused."""
        full, gone = self._data.send_routed(frames) if frames else ([], [])
        if not (full or gone or waiting):  # ZeroMQ took them all: the usual case
            batch.sent(copies, (), self._not_reading)
            return
        elsewhere: set[int] = set(gone)
        grown: dict[DataPeer, None] = {}
        hold = self._backlogs.hold
        if full and self.flow.pauses_producers:
            for position in full:
                unconfirmed, _sequence, index = copies[position]
                reader = targets[position]
                if unconfirmed is None:  # accepted once ZeroMQ takes it
                    elsewhere.add(position)
                    hold(reader, reader.backlog, frames[position], batch, index)
                else:  # answered by its Confirm, as if sent now
                    hold(reader, reader.backlog, frames[position])
                grown[reader] = None
            full = []
        elif full:
            self._count_not_sent(len(full))
        for reader, routed, copy in waiting:
            unconfirmed, _sequence, index = copy
            if unconfirmed is None:
                hold(reader, reader.backlog, routed, batch, index)
            else:
                copies.append(copy)
                hold(reader, reader.backlog, routed)
            grown[reader] = None
        batch.sent(copies, full, self._not_reading, elsewhere)
        if gone:
            went = Outcome.retry(f"an MTL reader of {self.name} went away (its connection is gone)")
            for position in gone:
                batch.withdraw(copies[position][2], went)
            self._count_not_sent(len(gone))
            self.peers.gone(targets[position] for position in gone)
        for reader in grown:
            self._backlogs.check(reader, reader.backlog)
