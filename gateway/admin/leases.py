"""``/leases``: DMP leases made and revoked at run time, with the admin token.

``POST /leases`` with a JSON object (`LEASE_EXAMPLE`) makes a lease;
``DELETE /leases/TEXT`` revokes one. Both need ``Authorization: Bearer
TOKEN`` with the admin token; the lease desk (`LeaseMaker`,
`gateway.protocols.dmp.leases.LeaseDesk`) grants and revokes.
"""

from __future__ import annotations

import json
from typing import Final, Protocol, cast

import attrs
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET, Request

from gateway.admin.base import AdminResource, AdminToken, NotFound, json_body, refused_without_token

__all__ = ["DEFAULT_LEASE_TTL_SECONDS", "LEASE_EXAMPLE", "LeaseMaker", "LeasesResource"]


class LeaseMaker(AdminToken, Protocol):
    """What ``/leases`` needs (`gateway.protocols.dmp.leases.LeaseDesk` is one)."""

    def make(
        self,
        listener: str,
        kind: str,
        target: str,
        ttl_seconds: float,
        identity: str | None = None,
    ) -> dict[str, object]:
        """Grant a lease, bound to ``identity`` if given.

        Raises:
            ValueError: With ``status`` and ``reason``: it cannot be granted.
        """

    def revoke(self, text: str) -> bool | Deferred[bool]:
        """Revoke a lease; whether it existed (later, when other nodes must hear of it).

        The Deferred fails with a ValueError carrying ``status`` and
        ``reason`` when the revocation could not be passed on.
        """


LEASE_KEYS: Final = frozenset({"listener", "sink", "feed", "ttl_seconds", "identity"})
LEASE_EXAMPLE: Final = (
    '{"listener": "dmp", "sink": "orders", "ttl_seconds": 3600, "identity": "alice"}'
    " (sink or feed; ttl_seconds and identity optional)"
)
DEFAULT_LEASE_TTL_SECONDS: Final = 3600.0


@attrs.frozen
class _LeaseAsked:
    """What a ``POST /leases`` body asks for."""

    listener: str
    kind: str
    target: str
    ttl_seconds: float
    identity: str | None


def _lease_asked(body: bytes) -> _LeaseAsked:
    """Read a ``POST /leases`` body, refusing anything it does not understand.

    A key it does not know is refused rather than ignored: a misspelt
    ``identity`` must not make a lease anyone holding it may use.

    Raises:
        ValueError: Not JSON, not an object, an unknown key, or a value of
            the wrong type; the message says which.
    """
    asked = json.loads(body)
    if not isinstance(asked, dict):
        raise ValueError("the body is not a JSON object")
    unknown = sorted(set(asked) - LEASE_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s): {', '.join(map(repr, unknown))}")
    kinds = [kind for kind in ("sink", "feed") if kind in asked]
    if len(kinds) != 1:
        raise ValueError("name a sink or a feed, one of them")
    kind = kinds[0]
    for key in ("listener", kind, "identity"):
        if key in asked and not isinstance(asked[key], str):
            raise ValueError(f"{key} must be a string")
    if "listener" not in asked:
        raise ValueError("name the listener")
    ttl = asked.get("ttl_seconds", DEFAULT_LEASE_TTL_SECONDS)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ValueError("ttl_seconds must be a number")
    return _LeaseAsked(
        listener=asked["listener"],
        kind=kind,
        target=asked[kind],
        ttl_seconds=float(ttl),
        identity=asked.get("identity"),
    )


class LeasesResource(AdminResource):
    """``POST /leases`` makes a DMP lease; ``DELETE /leases/TEXT`` revokes it."""

    def __init__(self, desk: LeaseMaker, text: str | None = None) -> None:
        super().__init__()
        self._desk = desk
        self._text = text

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """``/leases/TEXT``: one lease, for DELETE."""
        if self._text is None and path:
            return LeasesResource(self._desk, path.decode("utf-8", "replace"))
        return NotFound()

    def _respond(self, request: IRequest) -> bytes:
        allowed = b"DELETE" if self._text is not None else b"POST"
        if request.method != allowed:
            request.setHeader(b"Allow", allowed)
            return json_body(request, http.NOT_ALLOWED, {"error": "method not allowed"})
        refusal = refused_without_token(request, self._desk, "lease")
        if refusal is not None:
            return refusal
        if self._text is not None:
            revoked = self._desk.revoke(self._text)
            if isinstance(revoked, Deferred):
                _answer_later(request, revoked)
                return NOT_DONE_YET  # type: ignore[return-value]  # twisted.web's marker
            return _revocation(request, revoked)
        try:
            asked = _lease_asked(request.content.read() if request.content else b"")
        except ValueError as exc:
            return json_body(
                request, http.BAD_REQUEST, {"error": f"{exc}; want JSON like {LEASE_EXAMPLE}"}
            )
        try:
            made = self._desk.make(
                asked.listener, asked.kind, asked.target, asked.ttl_seconds, asked.identity
            )
        except ValueError as exc:
            status = getattr(exc, "status", http.BAD_REQUEST)
            return json_body(request, status, {"error": getattr(exc, "reason", str(exc))})
        return json_body(request, http.CREATED, made)


def _revocation(request: IRequest, found: bool) -> bytes:
    """The answer to ``DELETE /leases/TEXT``: 200, or 404 for a lease that is not known."""
    if found:
        return json_body(request, http.OK, {"revoked": True})
    return json_body(request, http.NOT_FOUND, {"error": "no such lease"})


def _answer_later(request: IRequest, revoked: Deferred[bool]) -> None:
    """Answer ``DELETE /leases/TEXT`` once the revocation reached the fleet (or did not)."""
    gone: list[bool] = []
    cast(Request, request).notifyFinish().addErrback(lambda _: gone.append(True))

    def write(body: bytes) -> None:
        if not gone:
            request.write(body)
            request.finish()

    def failed(failure: Failure) -> None:
        refusal = failure.value
        status = getattr(refusal, "status", http.INTERNAL_SERVER_ERROR)
        write(json_body(request, status, {"error": getattr(refusal, "reason", str(refusal))}))

    revoked.addCallbacks(lambda found: write(_revocation(request, found)), failed)
