"""Refused logins at one listener: the wait before each answer, the counter, the log line.

Every listener that checks a secret (SSMP ``secret``, stream SASL, QMQP
``A`` blocks, MTL SASL, DMP principals and leases) asks its `LoginRefusals`
two things: how long a login from this peer, for this identity, must wait
before it is even checked (`LoginRefusals.wait_seconds`), and, when it
refuses one, how long the refusal must wait before it is answered
(`LoginRefusals.refused`, which also counts it in
``msggateway_login_failures_total`` and logs it with the peer's address).
The connection reads nothing meanwhile; the wait is a ``callLater`` on the
listener's clock, never a blocking sleep. The policy and its reasons are in
`gateway.core.auth.LoginThrottle`.

A login waits at most once: if, when its wait is over, another refusal for
its address or identity is being answered (another connection's guess was
checked meanwhile), it is refused without being checked (`UNCHECKED`), at
once. So no connection waits longer than two of the longest delays, and
guesses from one address or at one identity are checked one delay apart
however many connections they come over. MTL (one request and its answer
at a time per session) refuses such a login, unchecked, once the wait owed
is over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from gateway.core.auth import LoginFailurePolicy, LoginThrottle
from gateway.metrics import GatewayMetrics

__all__ = ["UNCHECKED", "LoginRefusals", "peer_address", "peer_text"]

UNCHECKED: Final = (
    "not checked: a refused login from this address or for this identity is still being answered"
)
"""Why a login that waited once and still owed a wait was refused without being checked."""


def peer_address(peer: object) -> str | None:
    """The address a peer's refusals count against: its host (the port changes per connection)."""
    if peer is None:
        return None
    host = getattr(peer, "host", None)
    if isinstance(host, str):
        return host
    return str(peer)


def peer_text(peer: object) -> str:
    """A peer address for the log: ``host:port`` when it has both."""
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    if isinstance(host, str) and port is not None:
        return f"{host}:{port}"
    return str(peer) if peer is not None else "an unknown peer"


class LoginRefusals:
    """One listener's refused logins: when to answer them, counted and logged.

    Args:
        listener: The listener's name (the log's and the counter's label).
        policy: Its ``login_failure_*`` settings.
        clock: The listener's clock.
        metrics: Where ``msggateway_login_failures_total`` is, or None.
    """

    _log = Logger()

    def __init__(
        self,
        listener: str,
        policy: LoginFailurePolicy,
        clock: IReactorTime,
        metrics: GatewayMetrics | None,
    ) -> None:
        self.listener = listener
        self.policy = policy
        self.throttle = LoginThrottle(policy, clock)
        self._count: Callable[[], None] = (
            metrics.login_failures.labels(listener).inc if metrics is not None else _not_counted
        )

    def wait_seconds(self, peer: object, identity: str | None) -> float:
        """How long a login from ``peer`` for ``identity`` waits before it is checked (0: none)."""
        return self.throttle.wait_seconds(peer_address(peer), identity)

    def refused(
        self,
        *,
        peer: object,
        identity: str | None,
        mechanism: str,
        why: str,
        checked: bool = True,
    ) -> float:
        """Count and log a refused login; return how long its answer must wait.

        Args:
            peer: The peer's address (``transport.getPeer()``, or the
                address text ZeroMQ gives).
            identity: The identity it claimed (None: none).
            mechanism: How it tried (``LOGIN secret``, ``SASL PLAIN``...).
            why: Why it was refused, for the log only.
            checked: False for a login refused without being checked (a
                wait was still owed, `UNCHECKED`): counted and logged, but
                it makes no one wait longer, and is answered at once.
        """
        address = peer_address(peer)
        delay = self.throttle.failed(address, identity) if checked else 0.0
        self._count()
        self._log.warn(
            "{listener}: login refused: {identity} from {peer} ({mechanism}): {why};"
            " {failures} refused in a row, answered in {delay:.3g} s",
            listener=self.listener,
            identity="(no identity)" if identity is None else identity,
            peer=peer_text(peer),
            mechanism=mechanism,
            why=why,
            failures=self.throttle.failures(address, identity),
            delay=delay,
        )
        return delay

    def accepted(self, identity: str | None) -> None:
        """A login for ``identity`` was accepted: its refusals in a row are forgotten."""
        self.throttle.succeeded(identity)

    def spent(self, refused: int) -> bool:
        """Whether a connection with ``refused`` refused logins must now be closed."""
        return refused >= self.policy.per_connection


def _not_counted() -> None:
    """Without metrics, refusals are only logged."""
