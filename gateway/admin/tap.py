"""``/tap``: the messages passing a listener or a route, live, as JSON lines.

``GET /tap?listener=NAME|route=NAME&match=PATTERN&sample=RATE&max=N&per_second=N`` with
the admin token streams the messages passing there, as JSON lines written
by `gateway.core.tap.TapWriter`, until the client goes away or the gateway
stops (`TapResource.end_all`); ``msggateway tap`` reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request

from gateway.admin.base import (
    AdminToken,
    NotFound,
    json_body,
    refused_without_token,
    set_common_headers,
)
from gateway.admin.health import HealthReport
from gateway.core.addressing import AddressPattern, PatternError
from gateway.core.router import Router
from gateway.core.tap import (
    DEFAULT_TAP_RECORDS,
    MAX_TAP_PER_SECOND,
    MAX_TAP_RECORDS,
    Tap,
    TapWriter,
)

__all__ = [
    "MAX_TAPS",
    "TAP_CONTENT_TYPE",
    "TAP_END_REASON",
    "TAP_END_SECONDS",
    "TAP_PATH_HELP",
    "TapResource",
]

_N = TypeVar("_N", int, float)

TAP_CONTENT_TYPE: Final = b"application/x-ndjson"
"""``/tap`` answers newline-delimited JSON: one object per line, as it comes."""
TAP_PARAMETERS: Final = frozenset({"listener", "route", "match", "sample", "max", "per_second"})
MAX_TAPS: Final = 16
"""Taps open at once: each costs the router work per batch on its listener or route."""
TAP_END_SECONDS: Final = 1.0
"""How long a stopping gateway waits for its taps' clients to get their last lines."""
TAP_END_POLL_SECONDS: Final = 0.01
TAP_END_REASON: Final = "the gateway is stopping"
TAP_PATH_HELP: Final = (
    "watch messages live (admin token): ?listener=NAME or ?route=NAME,"
    " &match=PATTERN&sample=RATE&max=RECORDS&per_second=N"
)


class _TapRefusedError(Exception):
    """A ``/tap`` request that cannot be served: the status and the JSON to answer."""

    def __init__(self, status: int, answer: dict[str, object]) -> None:
        super().__init__(answer["error"])
        self.status = status
        self.answer = answer


class TapResource(Resource):
    """``GET /tap``: the messages passing a listener or a route, live, as JSON lines.

    Query: ``listener=NAME`` (a listener or upstream) or ``route=NAME``;
    ``match=PATTERN`` (route pattern syntax, on the source address or any
    recipient); ``sample=RATE`` (above 0, at most 1; default 1);
    ``max=RECORDS`` (records kept for a slow reader before they are
    dropped; default `DEFAULT_TAP_RECORDS`); ``per_second=N`` (take at
    most N records a second, the rest counted as sampled out; default: no
    cap). Needs the admin token, as
    ``/leases`` does. The answer is 200 with a chunked body written by
    `TapWriter` until the client goes away or the gateway stops; errors are
    JSON: 401/403 without the token, 400 for a bad query, 404 naming an
    unknown listener or route, 503 past `MAX_TAPS`.

    Args:
        router: Whose batches are tapped, and whose table names the routes.
        health: Names the listeners and upstreams.
        admin: Checks the admin token; None when none can be checked.
        clock: For the records' times and the writers' timers.
    """

    def __init__(
        self,
        router: Router,
        health: Callable[[], HealthReport],
        admin: AdminToken | None,
        clock: IReactorTime,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # twisted.web leaves it unannotated
        self._router = router
        self._health = health
        self._admin = admin
        self._clock = clock
        self.open: dict[TapWriter, Request] = {}
        """Each open tap's writer and its request."""

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Answer 404 for anything below ``/tap``."""
        return NotFound()

    def render(self, request: Request) -> bytes | int:
        """Start streaming a tap, or answer why not."""
        set_common_headers(request)
        if request.method != b"GET":
            request.setHeader(b"Allow", b"GET")
            return json_body(request, http.NOT_ALLOWED, {"error": "method not allowed"})
        refusal = refused_without_token(request, self._admin, "tap")
        if refusal is not None:
            return refusal
        try:
            tap = self._tap(request)
        except _TapRefusedError as exc:
            return json_body(request, exc.status, exc.answer)
        if len(self.open) >= MAX_TAPS:
            return json_body(
                request,
                http.SERVICE_UNAVAILABLE,
                {"error": f"{MAX_TAPS} taps are open already: close one first"},
            )
        request.setResponseCode(http.OK)
        request.setHeader(b"Content-Type", TAP_CONTENT_TYPE)
        writer = TapWriter(tap, self._router, request, self._clock)
        self.open[writer] = request
        request.notifyFinish().addBoth(self._closed, writer)
        writer.start()
        return NOT_DONE_YET

    def _closed(self, result: object, writer: TapWriter) -> None:
        """The response ended (or its connection went): stop tapping."""
        self.open.pop(writer, None)
        writer.stop(unregister=False)

    def end_all(self, reason: str) -> Deferred[None]:
        """End every open tap's response, saying why, and close its connection.

        Returns:
            A Deferred that fires once those connections have closed, their
            last lines sent (at most `TAP_END_SECONDS` later): the reactor
            drops the connections still open when it stops, unsent bytes
            and all.
        """
        transports = []
        for writer, request in list(self.open.items()):
            transport = request.transport
            writer.end(reason)
            request.finish()
            if transport is not None:
                transports.append(transport)
                transport.loseConnection()  # once what is written has gone
        done: Deferred[None] = Deferred()
        deadline = self._clock.seconds() + TAP_END_SECONDS

        def closed() -> None:
            if self._clock.seconds() >= deadline or not any(
                getattr(transport, "connected", False) for transport in transports
            ):
                done.callback(None)
            else:
                self._clock.callLater(TAP_END_POLL_SECONDS, closed)

        closed()
        return done

    def _tap(self, request: IRequest) -> Tap:
        """The tap the query asks for.

        Raises:
            _TapRefusedError: The query is wrong (400) or names what does not exist (404).
        """
        args: dict[str, list[str]] = {
            key.decode("utf-8", "replace"): [value.decode("utf-8", "replace") for value in values]
            for key, values in (request.args or {}).items()
        }
        unknown = sorted(set(args) - TAP_PARAMETERS)
        if unknown:
            raise _TapRefusedError(
                http.BAD_REQUEST,
                {
                    "error": f"unknown parameter(s): {', '.join(unknown)}",
                    "parameters": sorted(TAP_PARAMETERS),
                },
            )

        def one(name: str) -> str | None:
            values = args.get(name)
            if not values:
                return None
            if len(values) > 1:
                raise _TapRefusedError(http.BAD_REQUEST, {"error": f"give {name} once"})
            return values[0]

        listener, route = one("listener"), one("route")
        if (listener is None) == (route is None):
            raise _TapRefusedError(
                http.BAD_REQUEST,
                {"error": "name a listener (listener=NAME) or a route (route=NAME), one of them"},
            )
        table = self._router.table
        if listener is not None:
            report = self._health()
            known = sorted({*report.listeners, *report.upstreams, *table.sources()})
            if listener not in known:
                raise _TapRefusedError(
                    http.NOT_FOUND,
                    {
                        "error": f"no listener or upstream named {listener!r}",
                        "listener": listener,
                        "known": known,
                    },
                )
        if route is not None:
            names = [bound.route.name for bound in table.routes]
            if route not in names:
                raise _TapRefusedError(
                    http.NOT_FOUND,
                    {"error": f"no route named {route!r}", "route": route, "known": names},
                )
        match = one("match")
        try:
            pattern = None if match is None else AddressPattern(match)
        except PatternError as exc:
            raise _TapRefusedError(
                http.BAD_REQUEST, {"error": f"bad pattern: {exc}", "match": match}
            ) from None
        sample = _number(one("sample"), float, 1.0, "sample", "a rate above 0 and at most 1")
        if not (math.isfinite(sample) and 0.0 < sample <= 1.0):
            raise _TapRefusedError(
                http.BAD_REQUEST, {"error": "sample is a rate above 0 and at most 1"}
            )
        records = _number(one("max"), int, DEFAULT_TAP_RECORDS, "max", "a count of records")
        if not 1 <= records <= MAX_TAP_RECORDS:
            raise _TapRefusedError(
                http.BAD_REQUEST, {"error": f"max is 1 to {MAX_TAP_RECORDS} records"}
            )
        cap = one("per_second")
        per_second = None
        if cap is not None:
            per_second = _number(cap, float, 0.0, "per_second", "a count of records a second")
            if not (math.isfinite(per_second) and 0.0 < per_second <= MAX_TAP_PER_SECOND):
                raise _TapRefusedError(
                    http.BAD_REQUEST,
                    {"error": f"per_second is above 0 and at most {MAX_TAP_PER_SECOND:g}"},
                )
        return Tap(
            listener=listener,
            route=route,
            pattern=pattern,
            sample=sample,
            max_records=records,
            per_second=per_second,
            clock=self._clock,
        )


def _number(text: str | None, kind: Callable[[str], _N], default: _N, name: str, what: str) -> _N:
    """A query parameter's number, its default when absent.

    Raises:
        _TapRefusedError: It is not a number (400).
    """
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise _TapRefusedError(
            http.BAD_REQUEST, {"error": f"{name} is {what}, not {text!r}"}
        ) from None
