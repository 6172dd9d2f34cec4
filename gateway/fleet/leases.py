"""DMP leases across nodes: self-verifying lease texts, and the fleet's revocations.

DESIGN.md, "Scale: a fleet on RabbitMQ": a lease made on one node (the admin
API's ``POST /leases``, a principal connection's Direct.Put or Direct.Get)
is presented to whichever node the load balancer picks. Leases of the
configuration work on every node already (every node reads the same main
file and secrets); a lease made at run time carries what it grants instead
of naming a record kept on the node that made it:

- **The text** (`encode_token`) is the base64url (no padding) of a version
  octet, flags (sink or feed, bound to an identity, certificate needed), the
  expiry in milliseconds (u64), a random 12-octet id, the listener's name,
  the sink's or feed's name and the identity (each one length octet and
  UTF-8), followed by their HMAC-SHA256 under the fleet's lease secret (the
  secrets file's ``[fleet] lease_secret``, the same on every node). Any node
  checks it (`decode_token`, the MAC compared in constant time) without
  asking anyone. A DMP lease is a short string, so the text is at most 255
  octets: the names and the identity together take at most about 130
  characters (`LeaseTooLongError` otherwise).
- **Revocations** (`Revocations`) go on a RabbitMQ stream,
  ``msggateway.fleet.leases``, reached over the node's AMQP 0-9-1 connection
  (`IBackbone.replay`: no stream port, no second connection). Every node
  reads it from its first message after every (re)connection and keeps the
  ids revoked until their leases expire. A revocation names the lease's id
  and expiry, so it is forgotten when the lease would have expired, and
  the stream keeps `STREAM_MAX_AGE` (past the longest lease) in segments of
  `STREAM_SEGMENT_BYTES`: nothing grows without bound.
- **Knowing the revocations.** After replaying from the first message a node
  cannot tell where the stream ends, so it publishes a marker of its own
  and knows every revocation published before it once it reads the marker
  back (`Revocations.known`). Until then (a node that starts) a run-time
  lease waits for it, at most `REVOCATIONS_WAIT_SECONDS`, then is refused.
  A node that loses RabbitMQ hears no revocations: it goes on accepting
  run-time leases for ``stale_after_seconds`` (``[fleet]
  unhealthy_after_seconds``, after which ``/healthz`` sends clients
  elsewhere anyway), then refuses them until it has read the stream again.
  A revoked lease is thus refused on every node connected to RabbitMQ
  within a broker round trip, and on any node within
  ``unhealthy_after_seconds`` plus a reconnection.

Revoking closes no connection opened with the lease (as on a single node).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import struct
from collections.abc import Callable
from typing import Final

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.core.auth import Secrets
from gateway.core.interfaces import IBackbone
from gateway.fleet.backbone import Delivery, Published
from gateway.protocols.dmp.fleet import LeaseCheck
from gateway.protocols.dmp.settings import FEED, SINK, LeaseGrant

__all__ = [
    "MAX_LEASE_OCTETS",
    "REVOCATIONS_STREAM",
    "REVOCATIONS_WAIT_SECONDS",
    "STREAM_ARGUMENTS",
    "FleetLeases",
    "LeaseToken",
    "LeaseTooLongError",
    "Revocations",
    "decode_token",
    "encode_token",
]

TOKEN_VERSION: Final = 1
MAX_LEASE_OCTETS: Final = 255
"""A DMP lease is an AMQP short string."""
_DOMAIN: Final = b"msggateway DMP lease\x00"
"""What the MAC covers first: a lease secret reused elsewhere cannot sign a lease by accident."""
_HEAD: Final = struct.Struct(">BBQ12s")
_MAC_OCTETS: Final = 32
_FEED_FLAG: Final = 1
_IDENTITY_FLAG: Final = 2
_CERTIFIED_FLAG: Final = 4
_TEXT: Final = re.compile(r"[A-Za-z0-9_-]+")

REVOCATIONS_STREAM: Final = "msggateway.fleet.leases"
STREAM_MAX_AGE: Final = "367D"
"""Longer than the longest run-time lease (366 days): a revocation outlives its lease."""
STREAM_SEGMENT_BYTES: Final = 1_000_000
"""RabbitMQ drops a stream's old data a segment at a time: small segments let it go."""
STREAM_ARGUMENTS: Final = {
    "x-queue-type": "stream",
    "x-max-age": STREAM_MAX_AGE,
    "x-stream-max-segment-size-bytes": STREAM_SEGMENT_BYTES,
}
REVOCATIONS_WAIT_SECONDS: Final = 5.0
"""How long a run-time lease waits for a node that starts to know the revocations: a broker
round trip when RabbitMQ is there, a reconnection round when it is coming back."""
MAX_RECORD_BYTES: Final = 4096
_SWEEP_FLOOR: Final = 1024


class LeaseTooLongError(ValueError):
    """The lease would not fit a DMP lease (a short string of 255 octets)."""


@attrs.frozen(kw_only=True)
class LeaseToken:
    """What a run-time lease of the fleet says, once its MAC checked out.

    Attributes:
        listener: The DMP listener it is for.
        grant: What it opens (kind, target, expiry, identity binding).
        id: Its random id, in hex: what a revocation names.
    """

    listener: str
    grant: LeaseGrant
    id: str


def _short(text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > 255:
        raise LeaseTooLongError(f"{text[:40]!r}... is longer than 255 octets")
    return bytes((len(data),)) + data


def encode_token(secret: bytes, listener: str, grant: LeaseGrant, token_id: bytes) -> str:
    """The lease text of ``grant`` on ``listener``, signed with ``secret``.

    Args:
        secret: The fleet's lease secret.
        listener: The DMP listener's name.
        grant: What it opens; its ``expires`` must be set.
        token_id: 12 random octets.

    Raises:
        LeaseTooLongError: The text would not fit a DMP lease.
    """
    assert grant.expires is not None and len(token_id) == 12
    flags = _FEED_FLAG if grant.kind == FEED else 0
    if grant.identity is not None:
        flags |= _IDENTITY_FLAG
    if grant.certified:
        flags |= _CERTIFIED_FLAG
    payload = b"".join(
        (
            _HEAD.pack(TOKEN_VERSION, flags, round(grant.expires * 1000), token_id),
            _short(listener),
            _short(grant.target),
            _short(grant.identity) if grant.identity is not None else b"",
        )
    )
    mac = hmac.new(secret, _DOMAIN + payload, hashlib.sha256).digest()
    text = base64.urlsafe_b64encode(payload + mac).rstrip(b"=").decode("ascii")
    if len(text) > MAX_LEASE_OCTETS:
        raise LeaseTooLongError(
            f"the lease would be {len(text)} characters, and a DMP lease holds at most"
            f" {MAX_LEASE_OCTETS}: use shorter names or identity"
        )
    return text


def decode_token(secret: bytes, text: str) -> LeaseToken | None:
    """The lease ``text`` says, if it is a lease of this fleet (its MAC checks out).

    Its expiry is not checked here (the caller's clock is).
    """
    if not 0 < len(text) <= MAX_LEASE_OCTETS or not _TEXT.fullmatch(text):
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    if len(raw) < _HEAD.size + 2 + _MAC_OCTETS:
        return None
    payload, mac = raw[:-_MAC_OCTETS], raw[-_MAC_OCTETS:]
    expected = hmac.new(secret, _DOMAIN + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(expected, mac):
        return None
    version, flags, expires_ms, token_id = _HEAD.unpack_from(payload)
    if version != TOKEN_VERSION:
        return None
    strings: list[str] = []
    offset = _HEAD.size
    try:
        while offset < len(payload):
            size = payload[offset]
            end = offset + 1 + size
            if end > len(payload):
                return None
            strings.append(payload[offset + 1 : end].decode("utf-8"))
            offset = end
    except UnicodeDecodeError:
        return None
    bound = bool(flags & _IDENTITY_FLAG)
    if len(strings) != (3 if bound else 2):
        return None
    return LeaseToken(
        listener=strings[0],
        grant=LeaseGrant(
            kind=FEED if flags & _FEED_FLAG else SINK,
            target=strings[1],
            expires=expires_ms / 1000,
            identity=strings[2] if bound else None,
            certified=bool(flags & _CERTIFIED_FLAG),
        ),
        id=token_id.hex(),
    )


class Revocations:
    """The fleet's revoked run-time leases, as this node read them from the stream.

    Args:
        backbone: The node's connection to RabbitMQ.
        clock: Time and timers.
        stale_after_seconds: How long after losing RabbitMQ the node still
            counts on what it read (``[fleet] unhealthy_after_seconds``).
    """

    _log = Logger()

    def __init__(
        self, backbone: IBackbone, clock: IReactorTime, *, stale_after_seconds: float
    ) -> None:
        self._backbone = backbone
        self.node: str = backbone.node
        self._clock = clock
        self._stale_after = stale_after_seconds
        self._revoked: dict[str, float] = {}
        """Lease id to the lease's expiry."""
        self._sweep_at = _SWEEP_FLOOR
        self._caught_up = False
        """This connection read the stream up to this node's marker."""
        self._read_before = False
        """Some connection did: what was read then counts a while after a loss."""
        self._lost_at: float | None = None
        self._marker = ""
        self._waiting: list[tuple[Deferred[None], IDelayedCall]] = []
        self._warned = False
        backbone.replay(REVOCATIONS_STREAM, self._delivered, STREAM_ARGUMENTS)
        backbone.on_connected(self._connected)
        backbone.on_lost(self._lost)
        if backbone.ready:
            self._connected()

    # --- what users ask -------------------------------------------------------------------

    @property
    def known(self) -> bool:
        """Whether this node knows the fleet's revocations now (or lost them only lately)."""
        if self._caught_up:
            return True
        lost_at = self._lost_at
        return (
            self._read_before
            and lost_at is not None
            and self._clock.seconds() - lost_at <= self._stale_after
        )

    def revoked(self, lease_id: str) -> bool:
        """Whether the lease ``lease_id`` was revoked (and has not expired since)."""
        expires = self._revoked.get(lease_id)
        return expires is not None and expires > self._clock.seconds()

    def when_known(self, seconds: float = REVOCATIONS_WAIT_SECONDS) -> Deferred[None]:
        """Fires once `known`, or after ``seconds`` (check `known` again then)."""
        if self.known:
            return succeed(None)
        waiting: Deferred[None] = Deferred(lambda d: self._stop_waiting(d))
        timer = self._clock.callLater(seconds, self._wait_over, waiting)
        self._waiting.append((waiting, timer))
        return waiting

    def revoke(self, lease_id: str, expires: float) -> Deferred[bool]:
        """Revoke the lease ``lease_id`` on this node now, and on every node through the stream.

        Returns:
            Fires with True once RabbitMQ confirmed the revocation (every
            node reads it), False when it could not take it (no connection:
            the other nodes do not know).
        """
        self._add(lease_id, expires)
        done: Deferred[bool] = Deferred()
        body = json.dumps(
            {"revoke": lease_id, "expires": round(expires * 1000), "node": self.node},
            separators=(",", ":"),
        ).encode("ascii")

        def published(result: Published) -> None:
            if result is not Published.ROUTED:
                self._log.warn(
                    "fleet: node {node} could not publish the revocation of lease {lease}"
                    " ({result}): the other nodes accept it until it expires",
                    node=self.node,
                    lease=lease_id,
                    result=result.value,
                )
            done.callback(result is Published.ROUTED)

        self._backbone.publish(
            "", REVOCATIONS_STREAM, body, kind="revoke", mandatory=True, on_result=published
        )
        return done

    # --- the stream -----------------------------------------------------------------------

    def _connected(self) -> None:
        """Replaying from the first message: publish a marker, known once it comes back."""
        self._caught_up = False
        self._marker = secrets.token_hex(8)
        body = json.dumps({"sync": self._marker, "node": self.node}).encode("ascii")
        self._backbone.publish("", REVOCATIONS_STREAM, body, kind="sync", mandatory=True)

    def _lost(self) -> None:
        if self._caught_up:
            self._lost_at = self._clock.seconds()
        self._caught_up = False

    def _delivered(self, delivery: Delivery) -> None:
        try:
            if len(delivery.body) > MAX_RECORD_BYTES:
                raise ValueError(f"{len(delivery.body)} bytes")
            record = json.loads(delivery.body)
            if "revoke" in record:
                self._add(str(record["revoke"]), int(record["expires"]) / 1000)
            elif record.get("sync") == self._marker and record.get("node") == self.node:
                self._read_up_to_marker()
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if not self._warned:
                self._warned = True
                self._log.warn(
                    "fleet: an unreadable record on {stream}: {reason}; ignored",
                    stream=REVOCATIONS_STREAM,
                    reason=str(exc) or type(exc).__name__,
                )

    def _read_up_to_marker(self) -> None:
        self._caught_up = self._read_before = True
        self._lost_at = None
        self._log.info(
            "fleet: node {node} read the fleet's lease revocations ({count} in force)",
            node=self.node,
            count=sum(1 for expires in self._revoked.values() if expires > self._clock.seconds()),
        )
        waiting, self._waiting = self._waiting, []
        for deferred, timer in waiting:
            if timer.active():
                timer.cancel()
            deferred.callback(None)

    def _add(self, lease_id: str, expires: float) -> None:
        now = self._clock.seconds()
        if expires <= now:
            return
        self._revoked[lease_id] = max(expires, self._revoked.get(lease_id, 0.0))
        if len(self._revoked) >= self._sweep_at:
            self._revoked = {k: t for k, t in self._revoked.items() if t > now}
            self._sweep_at = max(_SWEEP_FLOOR, 2 * len(self._revoked))

    def _wait_over(self, waiting: Deferred[None]) -> None:
        self._waiting = [(d, t) for d, t in self._waiting if d is not waiting]
        waiting.callback(None)

    def _stop_waiting(self, waiting: Deferred[None]) -> None:
        for deferred, timer in self._waiting:
            if deferred is waiting and timer.active():
                timer.cancel()
        self._waiting = [(d, t) for d, t in self._waiting if d is not waiting]


class FleetLeases:
    """The run-time DMP leases of a fleet, as one node makes, checks and revokes them.

    Args:
        secrets: The secrets (``fleet_lease_secret``, read at each use: a
            reload changes it).
        revocations: The fleet's revocations as this node knows them.
        clock: For expiry.
    """

    def __init__(self, secrets: Secrets, revocations: Revocations, clock: IReactorTime) -> None:
        self._secrets = secrets
        self.revocations = revocations
        self._clock = clock

    def issue(
        self, listener: str, grant: LeaseGrant, token_id: Callable[[], bytes] | None = None
    ) -> str:
        """The lease text for ``grant`` on ``listener``.

        Raises:
            LeaseTooLongError: It would not fit a DMP lease.
            ValueError: The fleet has no lease secret.
        """
        secret = self._secrets.fleet_lease_secret
        if secret is None:
            raise ValueError("the fleet has no lease secret ([fleet] lease_secret)")
        made = token_id() if token_id is not None else secrets.token_bytes(12)
        return encode_token(secret, listener, grant, made)

    def token(self, listener: str, text: str) -> LeaseToken | None:
        """The lease of this fleet ``text`` is, for ``listener`` and not expired, if it is one."""
        secret = self._secrets.fleet_lease_secret
        if secret is None:
            return None
        token = decode_token(secret, text)
        if token is None or token.listener != listener:
            return None
        expires = token.grant.expires
        if expires is None or expires <= self._clock.seconds():
            return None
        return token

    def check(self, listener: str, text: str) -> LeaseGrant | LeaseCheck | None:
        """What the lease ``text`` opens on ``listener``, if it is a run-time lease in force.

        Returns:
            The grant; `LeaseCheck.REVOCATIONS_UNKNOWN` when it is a lease of
            this fleet but the node does not know the revocations now; None
            when it is no lease of this fleet (or expired, or revoked).
        """
        token = self.token(listener, text)
        if token is None:
            return None
        revocations = self.revocations
        if revocations.revoked(token.id):
            return None
        if not revocations.known:
            return LeaseCheck.REVOCATIONS_UNKNOWN
        return token.grant

    def revoke(self, listener: str, text: str) -> Deferred[bool] | None:
        """Revoke the lease ``text`` on every node.

        Returns:
            None when ``text`` is no lease of this fleet for ``listener`` in
            force; else a Deferred, True once RabbitMQ took the revocation.
        """
        token = self.token(listener, text)
        if token is None:
            return None
        assert token.grant.expires is not None
        return self.revocations.revoke(token.id, token.grant.expires)
