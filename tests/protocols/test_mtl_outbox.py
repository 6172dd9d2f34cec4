"""Tests for `gateway.protocols.mtl.outbox`: no socket, it sends through any function."""

from __future__ import annotations

from twisted.internet.task import Clock

from gateway.protocols.mtl.outbox import Outbox


def test_outbox_sends_together_on_the_next_turn() -> None:
    """Messages added outside a read burst go out in one send on the next reactor turn."""
    clock = Clock()
    sent: list[list[list[bytes]]] = []
    outbox = Outbox(clock, sent.append)
    outbox.add([b"a"])
    outbox.add([b"b"])
    assert sent == []
    clock.advance(0)
    assert sent == [[[b"a"], [b"b"]]]
    clock.advance(0)
    assert len(sent) == 1


def test_outbox_in_a_burst_waits_for_its_end() -> None:
    """While a burst is read nothing is scheduled; its end (flush) sends everything at once."""
    clock = Clock()
    sent: list[list[list[bytes]]] = []
    outbox = Outbox(clock, sent.append)
    outbox.reading = True
    outbox.add([b"a"])
    assert clock.getDelayedCalls() == []
    outbox.reading = False
    outbox.flush()
    assert sent == [[[b"a"]]]


def test_outbox_flush_and_clear_cancel_the_turn() -> None:
    """Flushing early sends once and cancels the next-turn send; clearing drops what waits."""
    clock = Clock()
    sent: list[list[list[bytes]]] = []
    outbox = Outbox(clock, sent.append)
    outbox.add([b"a"])
    outbox.flush()
    assert sent == [[[b"a"]]] and clock.getDelayedCalls() == []
    outbox.add([b"b"])
    outbox.clear()
    clock.advance(0)
    assert sent == [[[b"a"]]] and clock.getDelayedCalls() == []


def test_outbox_add_latest_replaces_the_peers_last_message_in_place() -> None:
    """A peer's waiting `add_latest` message is replaced in its place while it is the peer's last.

    Anything else added for that peer after it (or a flush) ends that: the
    next one is added as well, so a peer's commands keep their order.
    """
    clock = Clock()
    sent: list[list[list[bytes]]] = []
    outbox = Outbox(clock, sent.append)
    outbox.add_latest([b"w", b"confirm 2"])
    outbox.add([b"v", b"ping"])
    outbox.add_latest([b"w", b"confirm 5"])  # replaces confirm 2, before v's ping
    outbox.add_latest([b"v", b"confirm 1"])
    outbox.add([b"w", b"reject 6"])
    outbox.add_latest([b"w", b"confirm 9"])  # after the reject: added
    clock.advance(0)
    assert sent == [
        [
            [b"w", b"confirm 5"],
            [b"v", b"ping"],
            [b"v", b"confirm 1"],
            [b"w", b"reject 6"],
            [b"w", b"confirm 9"],
        ]
    ]
    outbox.add_latest([b"w", b"confirm 10"])  # a new turn: nothing to replace
    outbox.add_latest([b"w", b"confirm 11"])
    outbox.flush()
    assert sent[1:] == [[[b"w", b"confirm 11"]]]
    outbox.add_latest([b"w", b"confirm 12"])
    outbox.clear()
    outbox.add_latest([b"w", b"confirm 13"])
    outbox.flush()
    assert sent[2:] == [[[b"w", b"confirm 13"]]]
