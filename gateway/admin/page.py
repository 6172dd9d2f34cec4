"""The status page: ``/`` for a browser, and the script, style and icon it loads.

A browser asking for ``/`` (its Accept names ``text/html``) gets the page,
plain HTML; anything else gets the JSON index, as before. The page loads
``/static/status.js`` and ``/static/status.css`` (no other resource: the
Content-Security-Policy of every admin answer allows the gateway's own
script, style and requests only) and reads the status API
(`gateway.admin.status`) and ``/healthz`` every few seconds; its live tap
reads ``/tap`` with the admin token the user gives it, which it keeps in the
tab's sessionStorage. The files are package data
(``gateway/admin/static/``), read once when the site is built.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

from gateway.admin.base import AdminResource, NotFound

__all__ = [
    "HTML_CONTENT_TYPE",
    "STATIC_FILES",
    "StaticFile",
    "StaticFiles",
    "page",
    "wants_html",
]

HTML_CONTENT_TYPE: Final = b"text/html; charset=utf-8"
STATIC_FILES: Final = {
    "status.js": b"text/javascript; charset=utf-8",
    "status.css": b"text/css; charset=utf-8",
    "favicon.svg": b"image/svg+xml",
}
"""What ``/static/`` serves, with its content type."""
PAGE_FILE: Final = "status.html"


def _read(name: str) -> bytes:
    return (resources.files(__package__ or "gateway.admin") / "static" / name).read_bytes()


def page() -> bytes:
    """The status page's HTML."""
    return _read(PAGE_FILE)


def wants_html(request: IRequest) -> bool:
    """Whether the request is a browser's for a page (its Accept names ``text/html``)."""
    return b"text/html" in (request.getHeader(b"Accept") or b"")


class StaticFile(AdminResource):
    """One file of the page, its bytes kept in memory."""

    def __init__(self, body: bytes, content_type: bytes) -> None:
        super().__init__()
        self._body = body
        self._content_type = content_type

    def render_GET(self, request: IRequest) -> bytes:
        """Return the file."""
        request.setResponseCode(http.OK)
        request.setHeader(b"Content-Type", self._content_type)
        return self._body


class StaticFiles(AdminResource):
    """``/static/NAME``: the page's script, style and icon; 404 for anything else."""

    def __init__(self) -> None:
        super().__init__()
        self._files = {
            name.encode(): StaticFile(_read(name), content_type)
            for name, content_type in STATIC_FILES.items()
        }

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """The named file, if it is one of `STATIC_FILES` and nothing is below it."""
        found = self._files.get(path)
        if found is None or request.postpath:
            return NotFound()
        return found

    def render_GET(self, request: IRequest) -> bytes:
        """``/static`` itself is no file."""
        return NotFound().render(request)
