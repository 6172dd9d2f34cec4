"""Who may connect to an MTL listener: a ZeroMQ ZAP handler (RFC 27/ZAP).

libzmq asks the context's ZAP handler (a socket bound at
``inproc://zeromq.zap.01``) about every new peer of a socket that has a ZAP
domain, before any of its messages reach us. The listener answers from two
lists in its settings: ``allow_addresses`` (networks a peer's IP address
must be in) and ``curve_client_keys`` (CURVE public keys a peer must hold,
on a CURVE listener). An empty list allows all. Keys named in
``curve_identities`` are let in too, and the reply's User-Id is their
identity: libzmq then attaches it to each of the peer's messages, which is
what SASL EXTERNAL logs in with.

Every listener has a ZAP handler, lists or not: each connection it lets in
gets a number, in the reply's metadata as the property
`gateway.protocols.mtl.zmq.CONNECTION_PROPERTY`, which libzmq attaches to
each of that connection's messages. A routing id is the peer's choice, and
another connection may take it once the first is gone; the number is what
binds a session, a login and a lease to the connection that made them.

A refusal is counted (``peer-refused``) and logged with the peer's address
and CURVE key (Z85), once a minute at most for the same peer and reason
(`gateway.protocols.mtl.handshakes.RefusalLog`: a refused peer retries on
its own). The decision is the pure function `zap_reply`; `ZAPHandler` only
puts it on a socket.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import attrs

from gateway.protocols.mtl.handshakes import RefusalLog
from gateway.protocols.mtl.zmq import CONNECTION_PROPERTY

__all__ = ["ZAP_ENDPOINT", "ZAPHandler", "ZAPPolicy", "zap_peer", "zap_reply"]

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
ZAP_VERSION: Final = b"1.0"
_REQUEST_FRAMES: Final = 6
"""version, request id, domain, address, identity, mechanism; then credentials."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _networks(texts: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(text, strict=False) for text in texts)


@attrs.frozen
class ZAPPolicy:
    """Which peers a listener lets in.

    Attributes:
        networks: A peer's address must be in one of them; empty: any address.
        curve_keys: Raw 32-byte CURVE public keys a peer must hold; empty:
            any key (CURVE still encrypts and proves the server's identity).
        user_ids: Raw CURVE public key to the identity (ZAP User-Id) of
            the peer holding it; these keys are let in as well.
    """

    networks: tuple[Network, ...] = ()
    curve_keys: frozenset[bytes] = frozenset()
    user_ids: Mapping[bytes, str] = attrs.field(factory=dict)

    @classmethod
    def from_settings(
        cls,
        addresses: Iterable[str],
        z85_keys: Iterable[bytes],
        identities: Mapping[str, bytes] | None = None,
    ) -> ZAPPolicy:
        """Build a policy from validated settings (network texts, Z85 keys, identity to key)."""
        from zmq.utils import z85

        user_ids = {z85.decode(key): name for name, key in (identities or {}).items()}
        return cls(_networks(addresses), frozenset(z85.decode(key) for key in z85_keys), user_ids)

    @property
    def needed(self) -> bool:
        """Whether there is anything to enforce."""
        return bool(self.networks or self.curve_keys or self.user_ids)


def zap_reply(
    request: list[bytes], policy: ZAPPolicy, connection: int | None = None
) -> tuple[list[bytes], str | None]:
    """Decide one ZAP request; return the reply frames and why it was refused (None: allowed).

    ``request`` is the ZAP request without its envelope: version, request
    id, domain, address, identity, mechanism, credentials. A request that
    is not ZAP 1.0 gets status 500, as RFC 27 says. An allowed peer's reply
    carries ``connection`` as its metadata (`CONNECTION_PROPERTY`), if given.
    """
    if len(request) < _REQUEST_FRAMES or request[0] != ZAP_VERSION:
        request_id = request[1] if len(request) > 1 else b""
        return _reply(request_id, b"500", "not a ZAP 1.0 request"), "not a ZAP 1.0 request"
    request_id, address, mechanism = request[1], request[3], request[5]
    credentials = request[_REQUEST_FRAMES:]
    refused = _refusal(address, mechanism, credentials, policy)
    if refused is not None:
        return _reply(request_id, b"400", refused), refused
    user_id = ""
    if mechanism == b"CURVE" and credentials:
        user_id = policy.user_ids.get(credentials[0], "")
    metadata = b""
    if connection is not None:
        metadata = _property(CONNECTION_PROPERTY.encode("ascii"), b"%d" % connection)
    return _reply(request_id, b"200", "OK", user_id, metadata), None


def zap_peer(request: list[bytes]) -> tuple[str, str | None]:
    """The address of a ZAP request's peer, and its CURVE public key in Z85 (None: not CURVE)."""
    from zmq.utils import z85

    address = request[3].decode("ascii", "replace") if len(request) > 3 else "?"
    key = None
    if len(request) > _REQUEST_FRAMES and request[5] == b"CURVE":
        credential = request[_REQUEST_FRAMES]
        key = z85.encode(credential).decode("ascii") if len(credential) == 32 else "(malformed)"
    return address or "?", key


def _refusal(
    address: bytes, mechanism: bytes, credentials: list[bytes], policy: ZAPPolicy
) -> str | None:
    if policy.networks:
        try:
            ip = ipaddress.ip_address(address.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return f"address {address!r} is not an IP address"
        if not any(ip in network for network in policy.networks):
            return f"address {ip} is not allowed"
    if policy.curve_keys:
        if mechanism != b"CURVE" or not credentials:
            return f"mechanism {mechanism.decode('ascii', 'replace')} where CURVE is required"
        if credentials[0] not in policy.curve_keys and credentials[0] not in policy.user_ids:
            return "CURVE key not allowed"
    return None


def _reply(
    request_id: bytes, status: bytes, text: str, user_id: str = "", metadata: bytes = b""
) -> list[bytes]:
    return [ZAP_VERSION, request_id, status, text.encode(), user_id.encode(), metadata]


def _property(name: bytes, value: bytes) -> bytes:
    """One ZMTP metadata property (RFC 23): a short name, a 32-bit length, the value."""
    return bytes((len(name),)) + name + len(value).to_bytes(4, "big") + value


class ZAPHandler:
    """Answers the ZAP requests of one ZeroMQ context, on the reactor.

    Args:
        factory: The listener's txzmq factory (its context is the one served).
        policy: What to allow.
        listener: The listener's name, for the log.
        refusals: Where refusals are logged.
        on_refused: Called with the reason of each refusal (the listener counts it).
        before_reply: Called before each request is answered (the listener
            takes in the connections that closed before it, so that a
            routing id a new connection may take is free of the old one's).
    """

    def __init__(
        self,
        factory: Any,
        policy: ZAPPolicy,
        listener: str,
        refusals: RefusalLog,
        on_refused: Callable[[str], None] = lambda reason: None,
        before_reply: Callable[[], None] = lambda: None,
    ) -> None:
        import zmq

        from gateway.protocols.mtl.zmq import ZmqSocket

        self.policy = policy
        self.listener = listener
        self._refusals = refusals
        self._on_refused = on_refused
        self._before_reply = before_reply
        self._connections = itertools.count(1)
        self._socket = ZmqSocket(factory, zmq.ROUTER, self._on_request)
        self._socket.bind(ZAP_ENDPOINT)

    def _on_request(self, frames: list[bytes]) -> None:
        # A REQ-style envelope: the requester's identity, then an empty delimiter.
        if len(frames) < 2 or frames[1] != b"":
            return
        self._before_reply()
        request = frames[2:]
        reply, refused = zap_reply(request, self.policy, next(self._connections))
        if refused is not None:
            address, key = zap_peer(request)
            self._refusals.warn(
                ("zap", address, key, refused),
                "MTL listener {listener}: refused a peer from {address}{key}{repeated}: {reason}",
                listener=self.listener,
                address=address,
                key=f" with CURVE key {key}" if key is not None else "",
                reason=refused,
            )
            self._on_refused(refused)
        self._socket.send(frames[:2] + reply)
