"""What ZeroMQ says of an MTL listener's connections: refused handshakes and closed connections.

Some peers are refused before their first message, where the listener's
code never sees them: the ZAP handler (`gateway.protocols.mtl.zap`) refuses
an address or a CURVE key, and libzmq itself ends a handshake whose
security mechanism is not the socket's (a plaintext client on a CURVE
listener never reaches ZAP) or whose CURVE messages do not decrypt (a
client given another public key than the listener's). `HandshakeWatch`
reads libzmq's socket monitor for the last two, and for connections that
closed (the listener then ends what it kept for them); every refusal is
counted as a protocol error of its kind and logged through a `RefusalLog`.

A refused ZeroMQ peer tries again by itself, every 100 ms by default
(libzmq's reconnect interval), so `RefusalLog` logs a refusal once per
peer, reason and `REFUSAL_LOG_SECONDS`, saying how many more it had since
(each is still counted). libzmq's monitor does not give a refused
handshake's peer address, only the socket's; the log says so.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Final

import zmq
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

__all__ = ["REFUSAL_LOG_SECONDS", "HandshakeWatch", "RefusalLog", "handshake_failure"]

REFUSAL_LOG_SECONDS: Final = 60.0
"""A peer refused again for the same reason within this long is counted, not logged again."""
MAX_REFUSALS_REMEMBERED: Final = 1000
"""Peers and reasons `RefusalLog` remembers (the least recently logged first out)."""

WATCHED_EVENTS: Final = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
"""Refusals at ZAP (``HANDSHAKE_FAILED_AUTH``) are the ZAP handler's to log."""


class RefusalLog:
    """Warnings of refused peers, one per peer and reason each `REFUSAL_LOG_SECONDS`.

    Args:
        clock: The listener's clock.
        seconds: How long repeats of a refusal are only counted.
    """

    _log = Logger(namespace="gateway.protocols.mtl")

    def __init__(self, clock: IReactorTime, seconds: float = REFUSAL_LOG_SECONDS) -> None:
        self._clock = clock
        self._seconds = seconds
        self._seen: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def warn(self, subject: Hashable, text: str, **fields: Any) -> None:
        """Log ``text`` (a log format with a ``{repeated}`` field) unless ``subject`` just was.

        ``repeated`` says how many refusals of ``subject`` were only counted
        since its last line.
        """
        now = self._clock.seconds()
        seen = self._seen
        logged_at, repeats = seen.get(subject, (None, 0))
        if logged_at is not None and now - logged_at < self._seconds:
            seen[subject] = (logged_at, repeats + 1)
            return
        seen[subject] = (now, 0)
        seen.move_to_end(subject)
        if len(seen) > MAX_REFUSALS_REMEMBERED:
            seen.popitem(last=False)
        repeated = f" ({repeats} more like it since the last such line)" if repeats else ""
        self._log.warn(text, repeated=repeated, **fields)


def handshake_failure(event: int, value: int, curve: bool) -> tuple[str, str]:
    """The protocol error kind and the reason of a failed handshake, as a monitor reports it.

    Args:
        event: ``zmq.EVENT_HANDSHAKE_FAILED_*``.
        value: Its value (a ZMTP protocol error for ``..._PROTOCOL``).
        curve: Whether the listener uses CURVE.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return (
                    "plaintext-peer",
                    "it does not use CURVE, which this listener requires (a plaintext client,"
                    " or one not given the listener's public key as its server key)",
                )
            return (
                "mechanism-mismatch",
                "it uses a security mechanism (CURVE?) this plaintext listener does not",
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                "curve-handshake-failed",
                "its CURVE handshake does not decrypt: it was given another server public key"
                " than this listener's",
            )
        return "handshake-failed", f"ZMTP protocol error {value:#x}"
    why = f"it broke off its handshake ({os.strerror(value) if value > 0 else value})"
    if curve:
        why += ", as a plaintext client often does here, seeing that the listener wants CURVE"
    return "handshake-failed", why


class HandshakeWatch:
    """One listener socket's refused handshakes and closed connections, from libzmq's monitor.

    Args:
        socket: The socket watched (`ZmqSocket`).
        listener: The listener's name, for the log.
        which: ``control`` or ``data``, for the log.
        curve: Whether the listener uses CURVE.
        refusals: Where refusals are logged.
        count_error: Counts a protocol error of some kind.
        on_closed: Called with the file descriptor of a connection that
            closed (`ZmqSocket.source_fd` names a message's).
    """

    def __init__(
        self,
        socket: Any,
        *,
        listener: str,
        which: str,
        curve: bool,
        refusals: RefusalLog,
        count_error: Callable[[str], None],
        on_closed: Callable[[int], None],
    ) -> None:
        self.listener = listener
        self.which = which
        self.curve = curve
        self._refusals = refusals
        self._count_error = count_error
        self._on_closed = on_closed
        self._monitor = socket.watch(WATCHED_EVENTS, self._on_event)

    def read_now(self) -> None:
        """Take in the events waiting now (before a read burst of the socket watched)."""
        self._monitor.read_now()

    def _on_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self._on_closed(value)
            return
        kind, why = handshake_failure(event, value, self.curve)
        self._count_error(kind)
        self._refusals.warn(
            (self.which, kind),
            "MTL listener {listener}: refused a peer of the {which} socket at its ZeroMQ"
            " handshake{repeated}: {why} (ZeroMQ does not say from which address)",
            listener=self.listener,
            which=self.which,
            why=why,
        )
