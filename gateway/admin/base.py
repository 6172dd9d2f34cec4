"""What every admin resource shares: JSON answers, methods, headers and the admin token.

A resource of the admin site subclasses `AdminResource`: it answers GET
and HEAD (HEAD gets GET's headers and no body), a JSON 405 with an
``Allow`` header for any other method, a JSON 404 for anything below it,
and sets the headers every answer carries (`SECURITY_HEADERS`).
Resources that change something (``/leases``) or stream (``/tap``)
check the admin bearer token with `refused_without_token`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Protocol

from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

__all__ = [
    "ALLOWED_METHODS",
    "CONTENT_SECURITY_POLICY",
    "JSON_CONTENT_TYPE",
    "PATHS",
    "SECURITY_HEADERS",
    "AdminResource",
    "AdminToken",
    "NotFound",
    "json_body",
    "refused_without_token",
    "set_common_headers",
]

JSON_CONTENT_TYPE: Final = b"application/json"
"""RFC 8259 fixes JSON's encoding as UTF-8 and defines no charset parameter."""

ALLOWED_METHODS: Final = (b"GET", b"HEAD")

CONTENT_SECURITY_POLICY: Final = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
    b" connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The status page runs the gateway's own script and style, and talks to it alone."""

SECURITY_HEADERS: Final = (
    (b"Cache-Control", b"no-store"),
    (b"X-Content-Type-Options", b"nosniff"),
    (b"Content-Security-Policy", CONTENT_SECURITY_POLICY),
    (b"Referrer-Policy", b"no-referrer"),
    (b"X-Frame-Options", b"DENY"),
)
"""Headers on every answer: nothing is cached, sniffed, framed, or named in a Referer."""

PATHS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "/healthz": "whether the gateway is serving: listeners and upstreams",
        "/metrics": "Prometheus metrics, text exposition format",
        "/routes": "the routes in use, with live message counts",
    }
)
"""The read-only paths every admin site serves (a 404 lists them)."""


def set_common_headers(request: IRequest) -> None:
    """Set `SECURITY_HEADERS` on the answer."""
    for name, value in SECURITY_HEADERS:
        request.setHeader(name, value)


def json_body(request: IRequest, code: int, value: object) -> bytes:
    """Set the status and JSON content type, and return ``value`` encoded."""
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
    text = json.dumps(value, ensure_ascii=False, indent=2)
    return text.encode("utf-8") + b"\n"


class AdminResource(Resource):
    """A read-only admin resource: GET and HEAD, never cached, no children.

    Subclasses implement `render_GET`. Rendering is overridden as a whole so
    that a wrong method gets JSON rather than twisted.web's HTML error page,
    and HEAD gets the headers GET would, without twisted.web logging about
    the body it drops.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # twisted.web leaves it unannotated

    def render(self, request: IRequest) -> bytes:
        """Answer the request; HEAD gets GET's headers and an empty body."""
        set_common_headers(request)
        body = self._respond(request)
        if request.method == b"HEAD":
            request.setHeader(b"Content-Length", b"%d" % (len(body),))
            return b""
        return body

    def _respond(self, request: IRequest) -> bytes:
        """Return the body for an allowed method, or a 405 for any other."""
        if request.method not in ALLOWED_METHODS:
            request.setHeader(b"Allow", b", ".join(ALLOWED_METHODS))
            return json_body(
                request,
                http.NOT_ALLOWED,
                {
                    "error": "method not allowed",
                    "method": request.method.decode("latin-1"),
                    "allowed": [method.decode("ascii") for method in ALLOWED_METHODS],
                },
            )
        return self.render_GET(request)

    def render_GET(self, request: IRequest) -> bytes:
        """Return the response body; subclasses set status and content type."""
        raise NotImplementedError

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Answer 404 for anything below this resource."""
        return NotFound()


class NotFound(AdminResource):
    """Any path the admin site does not serve: a JSON 404, whatever the method."""

    def _respond(self, request: IRequest) -> bytes:
        """Return the 404 body, naming the path that was asked for."""
        return json_body(
            request,
            http.NOT_FOUND,
            {
                "error": "not found",
                "path": request.path.decode("utf-8", "replace"),
                "paths": list(PATHS),
            },
        )


class AdminToken(Protocol):
    """Checks the admin token (`gateway.protocols.dmp.leases.LeaseDesk` does)."""

    @property
    def enabled(self) -> bool:
        """Whether an admin token is configured."""

    def authorized(self, token: bytes | None) -> bool:
        """Whether the token is the admin token."""


def refused_without_token(request: IRequest, admin: AdminToken | None, api: str) -> bytes | None:
    """The answer to a request without the admin token (403 or 401), None when it has it.

    Args:
        request: Carries ``Authorization: Bearer TOKEN``.
        admin: Checks the token; None when the gateway has no way to.
        api: Names the API in the 403 answer.
    """
    if admin is None or not admin.enabled:
        return json_body(
            request,
            http.FORBIDDEN,
            {"error": f"the {api} API is off: set admin_token in the secrets file to turn it on"},
        )
    header = request.getHeader(b"Authorization") or b""
    token = header[7:] if header.startswith(b"Bearer ") else None
    if not admin.authorized(token):
        request.setHeader(b"WWW-Authenticate", b'Bearer realm="msggateway"')
        return json_body(request, http.UNAUTHORIZED, {"error": "a valid admin token is needed"})
    return None
