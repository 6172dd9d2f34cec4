"""Secrets: what peers must present, and what the gateway presents upstream; refused logins.

The secrets file is separate from the main config (DESIGN.md, "Security") so
that configs can be shared and reviewed without leaking credentials. It maps
identities to the secret they log in with (SSMP ``secret``, QMQP ``A``
blocks, MTL and stream PLAIN, DMP principals), DMP lease names to their
lease texts, upstream names to the secret the gateway logs in with, and
holds the admin API's token. Each is only what its table says: a lease text
or the admin token is never a login password.

`LoginThrottle` slows down password guessing: each refused login makes the
next answer to the same peer address, or for the same identity, wait
longer (`LoginFailurePolicy`).
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs
from twisted.internet.interfaces import IReactorTime

__all__ = [
    "ANY_IDENTITY",
    "DEFAULT_LOGIN_FAILURES",
    "MAX_TRACKED_LOGIN_KEYS",
    "LoginFailurePolicy",
    "LoginThrottle",
    "Secrets",
]

ANY_IDENTITY = "*"
"""A secret under this key is a shared secret any identity may log in with."""


def _frozen(value: Mapping[str, bytes]) -> Mapping[str, bytes]:
    return MappingProxyType(dict(value))


def _frozen_tables(
    value: Mapping[str, Mapping[str, bytes]],
) -> Mapping[str, Mapping[str, bytes]]:
    return MappingProxyType({name: _frozen(table) for name, table in value.items()})


@attrs.define
class Secrets:
    """The contents of the secrets file.

    Every listener and upstream holds the gateway's one `Secrets`; `update`
    swaps its contents when SIGHUP re-reads the file, so logins after a
    reload are checked against the new secrets (sessions already logged in
    stay).

    Attributes:
        logins: Identity to secret, for peers logging in to our listeners.
            The key ``*`` holds a shared secret valid for every identity.
        upstreams: Upstream name to the secret the gateway logs in with.
        frontends: TLS front-end listener name to its table of certificate
            name to the secret it logs in to its backend with (SSMP); ``*``
            in a table is the secret for every name.
        leases: DMP lease name (a DMP listener's ``leases``) to its lease
            text, what a DMP client presents. Not a login password.
        admin_token: The admin API's bearer token (None: the APIs that need
            it are off, unless the gateway made one). Not a login password.
        generated_admin_token: The token the gateway made and keeps in its
            data dir (`gateway.config.admintoken`), accepted while
            ``admin_token`` is None. Not from the file: a reload keeps it.
        fleet_username: The RabbitMQ user a fleet node logs in as (None: guest).
        fleet_password: Its password (None: guest's).
        fleet_relay_secret: What the nodes of a fleet prove to each other
            when one relays to another's stream listener
            (`gateway.protocols.stream.fleetlogin`); None: relays log in as
            their clients did, and routes append locally.
        fleet_lease_secret: The key that signs the DMP leases the nodes of a
            fleet make at run time, so that every node accepts them
            (`gateway.fleet.leases`); the same on every node. No login password.
    """

    logins: Mapping[str, bytes] = attrs.field(factory=dict, converter=_frozen)
    upstreams: Mapping[str, bytes] = attrs.field(factory=dict, converter=_frozen)
    frontends: Mapping[str, Mapping[str, bytes]] = attrs.field(
        factory=dict, converter=_frozen_tables
    )
    leases: Mapping[str, bytes] = attrs.field(factory=dict, converter=_frozen)
    admin_token: bytes | None = None
    fleet_username: str | None = None
    fleet_password: bytes | None = attrs.field(default=None, repr=False)
    fleet_relay_secret: bytes | None = attrs.field(default=None, repr=False)
    fleet_lease_secret: bytes | None = attrs.field(default=None, repr=False)
    generated_admin_token: bytes | None = attrs.field(default=None, repr=False)

    def verify(self, identity: str, secret: bytes | None) -> bool:
        """Whether ``secret`` is the right one for ``identity``.

        Compares in constant time; an identity without its own secret falls
        back to the shared ``*`` secret if there is one.
        """
        if secret is None:
            return False
        expected = self.logins.get(identity)
        if expected is None:
            expected = self.logins.get(ANY_IDENTITY)
        if expected is None:
            # Compare anyway so that unknown identities take as long as known ones.
            hmac.compare_digest(secret, secret)
            return False
        return hmac.compare_digest(expected, secret)

    def update(self, other: Secrets) -> None:
        """Take another secrets file's contents (a reload)."""
        self.logins = other.logins
        self.upstreams = other.upstreams
        self.frontends = other.frontends
        self.leases = other.leases
        self.admin_token = other.admin_token
        self.fleet_username = other.fleet_username
        self.fleet_password = other.fleet_password
        self.fleet_relay_secret = other.fleet_relay_secret
        self.fleet_lease_secret = other.fleet_lease_secret

    @property
    def effective_admin_token(self) -> bytes | None:
        """The token the admin API accepts: the file's ``admin_token``, else the made one."""
        return self.admin_token if self.admin_token is not None else self.generated_admin_token

    def is_admin_token(self, token: bytes | None) -> bool:
        """Whether ``token`` is the admin token (constant time; False without one)."""
        expected = self.effective_admin_token
        if expected is None or token is None:
            return False
        return hmac.compare_digest(expected, token)

    def credential_for(self, upstream: str) -> bytes | None:
        """Return the secret the gateway presents to an upstream, if any."""
        return self.upstreams.get(upstream)


# --- refused logins ----------------------------------------------------------------------

MAX_TRACKED_LOGIN_KEYS: Final = 16384
"""Peer addresses and identities a `LoginThrottle` remembers, at most; past it the one
whose last refusal is oldest is forgotten. At a few hundred bytes each (an identity is
kept to `_MAX_IDENTITY_CHARS`), a few megabytes, whatever a peer sends."""
_MAX_IDENTITY_CHARS: Final = 256


@attrs.frozen(kw_only=True)
class LoginFailurePolicy:
    """How refused logins are slowed down and cut off (a listener's ``login_failure_*`` keys).

    Attributes:
        delay_seconds: How long the answer to the first refused login from
            a peer address, or for an identity, waits; each further
            refusal in a row waits twice as long as the one before. 0: no
            wait (tests only).
        max_delay_seconds: The longest such wait.
        per_connection: Refused logins one connection may have; the last
            is followed by a close (protocols that close after the first
            refusal still do).
        reset_seconds: An address or identity with no refused login for
            this long starts from ``delay_seconds`` again.
    """

    delay_seconds: float = 1.0
    max_delay_seconds: float = 30.0
    per_connection: int = 3
    reset_seconds: float = 900.0

    def delay_after(self, failures: int) -> float:
        """The wait after ``failures`` refusals in a row: doubling from the first, capped."""
        if failures <= 0 or self.delay_seconds <= 0:
            return 0.0
        doublings = min(failures - 1, 64)  # past 64 doublings any delay is over the cap
        return min(self.delay_seconds * 2.0**doublings, self.max_delay_seconds)


DEFAULT_LOGIN_FAILURES: Final = LoginFailurePolicy()
"""The policy of a listener whose config says nothing (1 s doubling to 30 s, 3 a connection)."""


@attrs.define
class _Record:
    """One address's or identity's refused logins in a row, and when it may be answered."""

    failures: int = 0
    last: float = 0.0
    """When the last refusal was counted."""
    until: float = 0.0
    """No login from this address, or for this identity, is answered before then."""


class LoginThrottle:
    """Refused logins by peer address and by identity; how long each answer must wait.

    Each refused login counts against its peer's address and against the
    identity it claimed. It is answered after ``policy.delay_after(n)``,
    ``n`` the larger of the two counts of refusals in a row, and no login
    from that address or for that identity is answered (nor, in the
    listeners, even checked) before then: `wait_seconds`. Guesses sent in
    parallel, over many connections, are thus answered one delay after
    another, as a single connection's are. A successful login resets its
    identity's count, not its address's (a peer that has one valid login
    cannot use it to reset the count of its guesses at others). An address
    or identity without a refusal for ``policy.reset_seconds`` is
    forgotten; at most `MAX_TRACKED_LOGIN_KEYS` are remembered, the least
    recently refused forgotten first.

    Sans-IO but for the clock, which it only reads: the listeners wait with
    ``callLater``, never by blocking.

    Args:
        policy: The delays and their reset time.
        clock: Read for the time.
        max_tracked: Addresses and identities remembered, at most.
    """

    def __init__(
        self,
        policy: LoginFailurePolicy,
        clock: IReactorTime,
        max_tracked: int = MAX_TRACKED_LOGIN_KEYS,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._max_tracked = max_tracked
        # Least recently refused first: forgetting takes from the front.
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()

    def __len__(self) -> int:
        """Addresses and identities remembered now."""
        return len(self._records)

    def wait_seconds(self, address: str | None, identity: str | None) -> float:
        """How long a login from ``address`` for ``identity`` must wait before it is checked."""
        now = self._clock.seconds()
        self._forget_quiet(now)
        until = 0.0
        for key in _keys(address, identity):
            record = self._records.get(key)
            if record is not None and record.until > until:
                until = record.until
        return max(until - now, 0.0)

    def failed(self, address: str | None, identity: str | None) -> float:
        """Count a refused login; return how long its answer must wait (0: at once).

        The wait starts when any earlier one for the address or the
        identity ends, so that refusals are answered one after another.
        """
        now = self._clock.seconds()
        self._forget_quiet(now)
        records = [self._record(key, now) for key in _keys(address, identity)]
        if not records:
            return 0.0
        failures = max(record.failures for record in records)
        start = max([now, *(record.until for record in records)])
        until = start + self.policy.delay_after(failures)
        for record in records:
            record.until = until
        while len(self._records) > self._max_tracked:
            self._records.popitem(last=False)
        return until - now

    def succeeded(self, identity: str | None) -> None:
        """A login for ``identity`` was accepted: its refusals in a row start again from none."""
        if identity is not None:
            self._records.pop(("identity", identity[:_MAX_IDENTITY_CHARS]), None)

    def failures(self, address: str | None, identity: str | None) -> int:
        """Refusals in a row counted for the address or the identity, whichever has more."""
        self._forget_quiet(self._clock.seconds())
        counts = [
            self._records[key].failures for key in _keys(address, identity) if key in self._records
        ]
        return max(counts, default=0)

    def _record(self, key: tuple[str, str], now: float) -> _Record:
        record = self._records.pop(key, None)
        if record is None:
            record = _Record()
        record.failures += 1
        record.last = now
        self._records[key] = record  # the most recently refused: at the end
        return record

    def _forget_quiet(self, now: float) -> None:
        """Forget what was last refused ``reset_seconds`` ago or more, and whose wait is over."""
        records = self._records
        reset = self.policy.reset_seconds
        while records:
            record = next(iter(records.values()))
            if record.last + reset > now or record.until > now:
                return
            records.popitem(last=False)


def _keys(address: str | None, identity: str | None) -> list[tuple[str, str]]:
    keys = []
    if address:
        keys.append(("address", address))
    if identity is not None:
        keys.append(("identity", identity[:_MAX_IDENTITY_CHARS]))
    return keys
