"""The admin site: its index, its resource tree, and the site that serves it.

`make_admin_site` builds what the assembly listens with (loopback by
default): an `AdminSite` over the tree of `make_admin_resource`, whose
HTTP channels check Host and bound request bodies first
(`gateway.admin.channel`). The paths, each a module of this package:

- ``/``: the status page for a browser (`gateway.admin.page`), else the
  paths, each with a line about it (`IndexResource`); ``/static/``: the
  page's script, style and icon;
- ``/healthz``: whether the gateway is serving (`gateway.admin.health`);
- ``/metrics``: Prometheus metrics (`gateway.admin.metrics`);
- ``/routes``, ``/listeners``, ``/upstreams``, ``/streams``, ``/nodes``: the
  status API (`gateway.admin.status`);
- ``/leases``: DMP leases made and revoked, with the admin token
  (`gateway.admin.leases`), when the gateway has DMP listeners;
- ``/tap``: messages live, with the admin token (`gateway.admin.tap`).

Every answer is JSON except ``/metrics`` and the page's files, carries
``Cache-Control: no-store`` and a Content-Security-Policy that allows
the gateway's own script, style and requests only (`gateway.admin.base`),
and is generated afresh per request, so a route reload or a
listener going down shows at once. The read-only paths allow GET and HEAD
only (any other method gets a JSON 405 with an ``Allow`` header), and any
other path gets a JSON 404. They need no authentication: nothing served
there is secret (names, patterns, counts), and the endpoint is not meant
to leave the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IReactorCore, IReactorTime
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Site

from gateway.admin.base import PATHS, AdminResource, AdminToken, NotFound, json_body
from gateway.admin.channel import AdminChannel, AdminRequest, HostPolicy
from gateway.admin.health import HealthReport, HealthResource
from gateway.admin.leases import LeaseMaker, LeasesResource
from gateway.admin.metrics import MetricsResource
from gateway.admin.page import HTML_CONTENT_TYPE, StaticFiles, page, wants_html
from gateway.admin.status import (
    STATUS_PATHS,
    GatewayView,
    JSONListResource,
    RoutesResource,
    listeners,
    nodes,
    streams,
    upstreams,
)
from gateway.admin.tap import TAP_END_REASON, TAP_PATH_HELP, TapResource
from gateway.core.auth import Secrets
from gateway.core.router import Router
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.leases import LeaseDesk

__all__ = ["AdminSite", "IndexResource", "make_admin_resource", "make_admin_site"]


class IndexResource(AdminResource):
    """``/``: the paths the admin site serves, each with a line about it."""

    def __init__(self, paths: Mapping[str, str]) -> None:
        super().__init__()
        self._paths = paths
        self._page = page()

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Serve the index for ``/`` itself and 404 for unknown children."""
        if not path and not request.postpath:
            return self
        return NotFound()

    def render_GET(self, request: IRequest) -> bytes:
        """Return the status page to a browser, the index to anyone else."""
        request.setHeader(b"Vary", b"Accept")
        if wants_html(request):
            request.setResponseCode(http.OK)
            request.setHeader(b"Content-Type", HTML_CONTENT_TYPE)
            return self._page
        return json_body(request, http.OK, {"paths": dict(self._paths)})


class AdminSite(Site):
    """A `Site` that keeps no access log and does not announce its factory.

    Prometheus and health checks poll every few seconds; a line per request
    would drown the gateway's own events, and ``/metrics`` already counts
    what matters. Its channels check Host and bound request bodies
    (`AdminChannel`); it parses no HTML form bodies (nothing here takes one).
    """

    noisy = False
    # Twisted types its channels as the wrapper that can negotiate HTTP/2 over
    # TLS (ALPN); this site serves HTTP/1.1 only, on channels of its own.
    protocol = AdminChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: IResource,
        reactor: IReactorTime,
        tap: TapResource | None = None,
        hosts: HostPolicy | None = None,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]  # as above
            resource, AdminRequest, reactor=reactor, parsePOSTFormSubmission=False
        )
        # Already Twisted's default, stated because it matters here: a failing
        # render must not show code or values to whoever asks.
        self.displayTracebacks = False
        self._tap = tap
        self._hosts = hosts if hosts is not None else HostPolicy()
        self._shutdown: tuple[IReactorCore, object] | None = None

    def buildProtocol(self, addr: IAddress | None) -> AdminChannel:  # type: ignore[override]
        """A channel that answers by this site's Host policy (see ``protocol``)."""
        channel = super().buildProtocol(addr)  # type: ignore[no-untyped-call]  # as above
        assert isinstance(channel, AdminChannel)
        channel.hosts = self._hosts
        return channel

    def doStart(self) -> None:
        """Listening: end the taps before the reactor stops, while their last lines can go."""
        super().doStart()  # type: ignore[no-untyped-call]  # as above
        reactor = self.reactor
        if self._tap is not None and self._shutdown is None and IReactorCore.providedBy(reactor):
            trigger = reactor.addSystemEventTrigger("before", "shutdown", self._stopping)
            self._shutdown = (reactor, trigger)

    def _stopping(self) -> Deferred[None] | None:
        self._shutdown = None  # fired: not to be removed
        return None if self._tap is None else self._tap.end_all(TAP_END_REASON)

    def doStop(self) -> None:
        """Once the last port stops listening, end the taps' streams (if still open)."""
        super().doStop()  # type: ignore[no-untyped-call]  # as above
        if self.numPorts:
            return
        if self._shutdown is not None:
            reactor, trigger = self._shutdown
            self._shutdown = None
            reactor.removeSystemEventTrigger(trigger)
        if self._tap is not None:
            self._tap.end_all(TAP_END_REASON)

    def log(self, request: http.Request) -> None:
        """Skip the access log line."""


def _build(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    leases: LeaseMaker | None,
    clock: IReactorTime | None,
    admin: AdminToken | None,
    gateway: GatewayView | None,
) -> tuple[IResource, TapResource | None]:
    paths = {**PATHS, **STATUS_PATHS}
    tap = None
    if clock is not None:
        tap = TapResource(router, health, admin if admin is not None else leases, clock)
        paths["/tap"] = TAP_PATH_HELP
    root = IndexResource(MappingProxyType(paths))
    root.putChild(b"healthz", HealthResource(health))
    root.putChild(b"metrics", MetricsResource(metrics))
    root.putChild(b"routes", RoutesResource(router, metrics, gateway))
    for name, make in (
        (b"listeners", listeners),
        (b"upstreams", upstreams),
        (b"streams", streams),
        (b"nodes", nodes),
    ):
        root.putChild(name, JSONListResource(functools.partial(make, gateway)))
    root.putChild(b"static", StaticFiles())
    if leases is not None:
        root.putChild(b"leases", LeasesResource(leases))
    if tap is not None:
        root.putChild(b"tap", tap)
    return root, tap


def make_admin_resource(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    leases: LeaseMaker | None = None,
    clock: IReactorTime | None = None,
    admin: AdminToken | None = None,
    gateway: GatewayView | None = None,
) -> IResource:
    """Build the admin resource tree (also what in-memory tests serve).

    Args:
        metrics: The service's metrics; ``/metrics`` serves its registry and
            ``/routes`` reads its per-route collectors.
        router: The router whose current table ``/routes`` lists and whose
            batches ``/tap`` watches.
        health: Called per ``/healthz`` request for a fresh report.
        leases: Makes and revokes DMP leases (``/leases``), if any.
        clock: Times ``/tap``'s records; without it there is no ``/tap``.
        admin: Checks ``/tap``'s admin token (default: ``leases``; with
            neither, ``/tap`` answers 403).
        gateway: What the status API shows (listeners, upstreams, log
            streams, nodes, forwarders); without it those lists are empty.

    Returns:
        The root resource: ``/`` (the index, or the status page for a
        browser), ``/healthz``, ``/metrics``, the status API (``/routes``,
        ``/listeners``, ``/upstreams``, ``/streams``, ``/nodes``), the page's
        ``/static/`` files, ``/leases`` and ``/tap``.
    """
    root, _tap = _build(
        metrics=metrics,
        router=router,
        health=health,
        leases=leases,
        clock=clock,
        admin=admin,
        gateway=gateway,
    )
    return root


def make_admin_site(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    reactor: IReactorTime,
    leases: LeaseMaker | None = None,
    secrets: Secrets | None = None,
    allowed_hosts: Iterable[str] = (),
    gateway: GatewayView | None = None,
) -> Site:
    """Build the admin site, ready to listen on a (loopback) endpoint.

    Args:
        metrics: The service's metrics; ``/metrics`` serves its registry and
            ``/routes`` reads its per-route collectors.
        router: The router whose current table ``/routes`` lists and whose
            batches ``/tap`` watches.
        health: Called per ``/healthz`` request for a fresh report.
        reactor: Times out idle HTTP connections, times ``/tap``.
        leases: Makes and revokes DMP leases (``/leases``), if any.
        secrets: Holds the admin token (the secret of ``admin``), checked
            as ``/leases`` checks it; without it (and without ``leases``)
            ``/tap`` answers 403.
        allowed_hosts: Host names and addresses requests may name besides
            the address they arrive on (`HostPolicy`).
        gateway: What the status API shows (`make_admin_resource`).

    Returns:
        A `Site` over the resources of `make_admin_resource`, without an
        access log, that ends ``/tap`` streams when it stops listening,
        and answers only requests with an allowed Host and a small body.

    Raises:
        gateway.admin.channel.HostError: An allowed host names no host.
    """
    admin = leases
    if admin is None and secrets is not None:
        admin = LeaseDesk({}, secrets, reactor)  # no DMP listeners: it only checks the token
    root, tap = _build(
        metrics=metrics,
        router=router,
        health=health,
        leases=leases,
        clock=reactor,
        admin=admin,
        gateway=gateway,
    )
    return AdminSite(root, reactor=reactor, tap=tap, hosts=HostPolicy.of(allowed_hosts))
