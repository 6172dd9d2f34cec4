"""The inbound side of a batch: what one read decoded, handed to the router at once.

A listener connection (or an upstream that receives) adds each message it
decodes to its `Inbox`, with a token saying how to answer that message's
sender (a QMQP block id, an SSMP response slot, an MTL confirm tag). When the
read is drained it calls `Inbox.dispatch`: the router gets the whole read as
one batch, and the inbox calls ``answer`` once per message as its result is
known (`Router.route`: at once for a message no route takes, then each
route's messages together when that route's batch is answered; an adapter
whose protocol answers in request order keeps its own order, as the SSMP
server's response slots do). Nothing waits for a batch
to fill (DESIGN.md, "The batch is the unit of work").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from twisted.logger import Logger

from gateway.core.message import Message, Outcome
from gateway.core.router import Result, Router

__all__ = ["Inbox", "Result"]

T = TypeVar("T")


class Inbox(Generic[T]):
    """The messages of one read on their way to the router.

    Args:
        router: Where the batch goes.
        source: The listener or upstream name the messages arrived at.
        answer: Called with each message's token and result once its
            routes have answered (not necessarily in the order added).
        answer_batch: If given, called instead of ``answer`` with the tokens
            and outcomes of messages answered together (a route's batch, in
            the order added): the adapter answers them in one go.
    """

    __slots__ = ("_answer", "_answer_batch", "_messages", "_router", "_source", "_tokens")

    _log = Logger(namespace="gateway.core.inbox")

    def __init__(
        self,
        router: Router,
        source: str,
        answer: Callable[[T, Result], None],
        answer_batch: Callable[[list[T], list[Outcome]], None] | None = None,
    ) -> None:
        self._router = router
        self._source = source
        self._answer = answer
        self._answer_batch = answer_batch
        self._messages: list[Message] = []
        self._tokens: list[T] = []

    def __len__(self) -> int:
        return len(self._messages)

    def add(self, message: Message, token: T) -> None:
        """Take a message for the next `dispatch`."""
        self._messages.append(message)
        self._tokens.append(token)

    def dispatch(self) -> None:
        """Hand everything added since the last call to the router, as one batch."""
        messages = self._messages
        if not messages:
            return
        tokens = self._tokens
        self._messages = []
        self._tokens = []
        answer = self._answer
        answered = bytearray(len(tokens))

        def routed(index: int, result: Result) -> None:
            answered[index] = 1
            answer(tokens[index], result)

        routed_batch = None
        answer_batch = self._answer_batch
        if answer_batch is not None:

            def routed_batch(indices: list[int], outcomes: list[Outcome]) -> None:
                for index in indices:
                    answered[index] = 1
                answer_batch([tokens[index] for index in indices], outcomes)

        try:
            self._router.route(self._source, messages, routed, routed_batch)
        except Exception:
            self._log.failure(
                "{source}: routing {count} message(s) failed unexpectedly",
                source=self._source,
                count=len(tokens),
            )
            retry = Outcome.retry("internal error")
            for index, token in enumerate(tokens):
                if not answered[index]:
                    answer(token, retry)
