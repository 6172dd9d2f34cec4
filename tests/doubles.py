"""Small real implementations the tests share, for views one message at a time.

The core moves batches; many protocol and router tests are clearest when a
destination answers each message by itself (a Deferred per message that the
test fires) or when one message is routed alone. These helpers give those
views on top of the batch interfaces, without a second path in the gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.core.auth import LoginFailurePolicy
from gateway.core.batch import UNANSWERED
from gateway.core.message import Message, Outcome
from gateway.core.router import Result, Router, Unrouted

__all__ = ["NO_LOGIN_WAIT", "WritingTransport", "deliver_each", "dispatch_one"]

_log = Logger(namespace="tests.doubles")

NO_LOGIN_WAIT = LoginFailurePolicy(delay_seconds=0.0, per_connection=1000)
"""Refused logins answered at once, never closed for their number: for tests of what a
refusal says, not of when (tests/protocols/test_logins.py tests the waits)."""


def deliver_each(
    deliver_one: Callable[[Message], Deferred[Outcome]], messages: Sequence[Message]
) -> Deferred[list[Outcome]]:
    """A batch answered by a function that takes one message at a time.

    Every message is started at once; the batch fires when the last has
    answered. Cancelling the batch (the router's deadline) cancels the
    messages still open, which then answer `UNANSWERED`; a message whose
    Deferred fails is logged and answers retry, as an adapter's bug would be.
    """
    started = [deliver_one(message).addErrback(_broken) for message in messages]

    def cancel(_: Deferred[list[Outcome]]) -> None:
        for d in started:
            if not d.called:
                d.cancel()

    result: Deferred[list[Outcome]] = Deferred(cancel)
    DeferredList(started).addCallback(
        lambda pairs: [outcome for _ok, outcome in pairs]
    ).chainDeferred(result)
    return result


def _broken(failure: Failure) -> Outcome:
    if failure.check(CancelledError):
        return UNANSWERED
    _log.failure("a delivery failed unexpectedly", failure)
    return Outcome.retry("internal error")


def dispatch_one(router: Router, source: str, message: Message) -> Deferred[Outcome] | Unrouted:
    """Route one message alone: `Unrouted` at once when no route takes it, else its outcome."""
    d: Deferred[Outcome] = Deferred()
    unrouted: list[Unrouted] = []

    def answer(_index: int, result: Result) -> None:
        if isinstance(result, Unrouted):
            unrouted.append(result)
        else:
            d.callback(result)

    router.route(source, (message,), answer)
    return unrouted[0] if unrouted else d


class WritingTransport(StringTransport):
    """A StringTransport with the parts of a TCP connection `flush_now` looks at.

    It has no socket (`gateway.protocols.sendnow` writes to it as usual), and
    holds what it was given until the reactor, or a push, writes it
    (``_tempDataLen``, as Twisted's transports count it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.connected = True
        self.disconnecting = False
        self.producerPaused = False
        self.pushed = 0
        self._tempDataLen = 0

    def write(self, data: bytes) -> None:
        """Keep the bytes, as not yet sent."""
        super().write(data)
        self._tempDataLen += len(data)

    def doWrite(self) -> None:  # noqa: N802 (IWriteDescriptor's name)
        """Count the pushes; the bytes are sent."""
        self.pushed += 1
        self._tempDataLen = 0
