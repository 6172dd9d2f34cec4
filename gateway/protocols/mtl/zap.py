"""Who may connect to an MTL listener: a ZeroMQ ZAP handler (RFC 27/ZAP).

libzmq asks the context's ZAP handler (a socket bound at
``inproc://zeromq.zap.01``) about every new peer of a socket that has a ZAP
domain, before any of its messages reach us. The listener answers from two
lists in its settings: ``allow_addresses`` (networks a peer's IP address
must be in) and ``curve_client_keys`` (CURVE public keys a peer must hold,
on a CURVE listener). An empty list allows all. Keys named in
``curve_identities`` are let in too, and the reply's User-Id is their
identity: libzmq then attaches it to each of the peer's messages, which is
what SASL EXTERNAL logs in with. The decision is the pure function
`zap_reply`; `ZAPHandler` only puts it on a socket.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import attrs
from twisted.logger import Logger

__all__ = ["ZAP_ENDPOINT", "ZAPHandler", "ZAPPolicy", "zap_reply"]

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


def zap_reply(request: list[bytes], policy: ZAPPolicy) -> tuple[list[bytes], str | None]:
    """Decide one ZAP request; return the reply frames and why it was refused (None: allowed).

    ``request`` is the ZAP request without its envelope: version, request
    id, domain, address, identity, mechanism, credentials. A request that
    is not ZAP 1.0 gets status 500, as RFC 27 says.
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
    return _reply(request_id, b"200", "OK", user_id), None


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


def _reply(request_id: bytes, status: bytes, text: str, user_id: str = "") -> list[bytes]:
    return [ZAP_VERSION, request_id, status, text.encode(), user_id.encode(), b""]


class ZAPHandler:
    """Answers the ZAP requests of one ZeroMQ context, on the reactor.

    Args:
        factory: The listener's txzmq factory (its context is the one served).
        policy: What to allow.
        listener: The listener's name, for the log.
        on_refused: Called with the reason of each refusal (the listener counts it).
    """

    _log = Logger()

    def __init__(
        self,
        factory: Any,
        policy: ZAPPolicy,
        listener: str,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        import zmq

        from gateway.protocols.mtl.zmq import ZmqSocket

        self.policy = policy
        self.listener = listener
        self._on_refused = on_refused
        self._socket = ZmqSocket(factory, zmq.ROUTER, self._on_request)
        self._socket.bind(ZAP_ENDPOINT)

    def _on_request(self, frames: list[bytes]) -> None:
        # A REQ-style envelope: the requester's identity, then an empty delimiter.
        if len(frames) < 2 or frames[1] != b"":
            return
        reply, refused = zap_reply(frames[2:], self.policy)
        if refused is not None:
            self._log.warn(
                "MTL listener {listener}: refused a peer: {reason}",
                listener=self.listener,
                reason=refused,
            )
            self._on_refused(refused)
        self._socket.send(frames[:2] + reply)
