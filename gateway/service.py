"""The one place where configuration becomes a running gateway.

`build_gateway` turns a validated `GatewayConfig` and a reactor into a
`GatewayService` (a `MultiService`): one `ListenerService` per listener,
one client service per upstream, the admin site, and the router that joins
them. Only `makeService` (the twistd entry point) touches the global reactor.

A clean stop (SIGTERM, SIGINT) drains before it closes anything: see
`GatewayService.stopService`.

With ``[fleet] processes`` above 1, `makeService` returns the supervisor
of that many worker processes instead (`gateway.fleet.supervisor`), and
each worker (``--worker I``) is a gateway built here like any other, from
its own view of the configuration (`gateway.fleet.worker`), whose
listeners share their ports with the other workers' (SO_REUSEPORT,
`gateway.fleet.reuseport`).
"""

from __future__ import annotations

import gc
import resource
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from prometheus_client import ProcessCollector
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocolFactory,
    IReactorCore,
    IReactorTime,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.admin.health import HealthReport
from gateway.admin.site import make_admin_site
from gateway.codecs.ssmp import ANONYMOUS as SSMP_ANONYMOUS
from gateway.config import (
    DEFAULT_CONFIG_NAME,
    ConfigError,
    GatewayConfig,
    ListenerConfig,
    UpstreamConfig,
    load_config,
    load_default_config,
    reload_routes,
    reload_secrets,
)
from gateway.config.admintoken import provide_admin_token
from gateway.config.endpoints import endpoint_with_port
from gateway.config.fleet import node_id, worker_node
from gateway.config.insecure import insecure_settings
from gateway.core.batch import all_same
from gateway.core.durable import DurableRoutes
from gateway.core.interfaces import IDestination
from gateway.core.log import FsyncPolicy, LogStore, Retention
from gateway.core.message import Message, Outcome
from gateway.core.outcomes import OUTCOME_STREAM, OutcomeRecorder
from gateway.core.router import Route, Router, RouteTable, bind_routes
from gateway.fleet.backbone import Backbone, heartbeat_interval, make_backbone
from gateway.fleet.confighash import live_config_hash
from gateway.fleet.dmp import FleetDMP
from gateway.fleet.hub import FleetHub
from gateway.fleet.leases import FleetLeases, Revocations
from gateway.fleet.locks import FleetLock, FleetLocks
from gateway.fleet.members import Membership
from gateway.fleet.streams import StreamOwnership
from gateway.fleet.worker import WORKER_PORT_SUFFIX
from gateway.logformat import select_log_format
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.client import DMPUpstream
from gateway.protocols.dmp.leases import LeaseDesk
from gateway.protocols.dmp.server import DMPServerFactory
from gateway.protocols.frontend.server import FrontendServerFactory
from gateway.protocols.listener import ListenerFactory
from gateway.protocols.mtl.client import MTLUpstream
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.service import MTLEndpoint
from gateway.protocols.mtl.settings import zmq_bind_address, zmq_connect_address
from gateway.protocols.qmqp.client import QMQPUpstream
from gateway.protocols.qmqp.server import QMQPServerFactory
from gateway.protocols.ssmp.client import SSMPUpstream
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.server import SSMPServerFactory
from gateway.protocols.stream.bridge import (
    StreamDestination,
    StreamRouteFeeds,
    dead_letter_writer,
)
from gateway.protocols.stream.client import StreamUpstream
from gateway.protocols.stream.mapping import durable_entries, message_from_entry
from gateway.protocols.stream.relay import StreamFleet, connect_tcp, connect_tls
from gateway.protocols.stream.routed import OwnerAppends
from gateway.protocols.stream.server import StreamServerFactory
from gateway.startup import StartFailed
from gateway.systemd import tell_systemd
from gateway.tls import client_endpoint_at, reload_server_tls

__all__ = [
    "GatewayService",
    "ListenerService",
    "Options",
    "StartFailed",
    "build_gateway",
    "makeService",
]


class ListenerService(Service):
    """Listens on one endpoint while running; knows the address it got.

    Like Twisted's `StreamServerEndpointService`, but it reports the bound
    address (port 0 in tests) and a Deferred that fires once listening.
    A factory that advertises its own address (``listening_on``) learns the
    address bound, unless ``advertised`` is False (a worker's stream
    listener advertises its own port, not the shared one).
    """

    _log = Logger()

    def __init__(
        self,
        name: str,
        endpoint: IStreamServerEndpoint,
        factory: IProtocolFactory,
        *,
        advertised: bool = True,
    ) -> None:
        self.setName(name)
        self.endpoint = endpoint
        self.factory = factory
        self.advertised = advertised
        self.port: IListeningPort | None = None
        self.listening: Deferred[IListeningPort] | None = None
        self._stopped: Deferred[None] | None = None

    def startService(self) -> None:
        """Start listening.

        Raises:
            StartFailed: The endpoint could not listen right away (port in
                use, bad address); the reason is logged. twistd then exits
                with status 1 instead of running without the listener.
        """
        super().startService()
        listening = self.endpoint.listen(self.factory).addCallback(self._listening)
        if listening.called:  # tcp: and mtls: listen synchronously
            failed: list[Failure] = []
            listening.addErrback(failed.append)
            if failed:
                self.listening = None
                if not failed[0].check(CannotListenError):
                    failed[0].raiseException()  # not a port's problem: a bug, with its traceback
                self._log.critical(
                    "msggateway cannot start: listener {listener}: {reason}",
                    listener=self.name,
                    reason=failed[0].getErrorMessage(),
                )
                raise StartFailed
        self.listening = listening

    def _listening(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        # Factories that advertise their own address (stream metadata) learn it here.
        hook = getattr(self.factory, "listening_on", None)
        if hook is not None and self.advertised:
            hook(port.getHost())
        return port

    def stopService(self) -> Deferred[None] | None:
        """Stop listening, if `stop_listening` did not already.

        The gateway's drain has closed the connections of its own
        listeners by now; the reactor closes any left (the admin site's) on exit.
        """
        super().stopService()
        self.stop_listening()
        stopped, self._stopped = self._stopped, None
        return stopped

    def stop_listening(self) -> None:
        """Accept no more connections; those open stay open."""
        if self.port is not None:
            port, self.port = self.port, None
            self._stopped = port.stopListening()
        elif self.listening is not None and not self.listening.called:
            self.listening.cancel()

    @property
    def address(self) -> str | None:
        """``host:port`` listened on, or None while not listening."""
        if self.port is None:
            return None
        host = self.port.getHost()
        return f"{getattr(host, 'host', host)}:{getattr(host, 'port', '')}"


@attrs.define
class _Endpoint:
    """What the assembly keeps of each listener or upstream."""

    name: str
    destination: IDestination
    service: IService
    healthy: Callable[[], bool]
    upstream: bool


class GatewayService(MultiService):
    """The running gateway: listeners, upstreams, admin and the router."""

    _log = Logger()
    node = ""
    """This process's node id (`gateway.fleet.node`), set by `build_gateway`."""
    backbone: Backbone | None = None
    """The node's connection to the fleet's RabbitMQ (``[fleet] amqp``), if any."""
    locks: FleetLocks | None = None
    """The node's locks for work that runs once per fleet (with ``backbone``)."""
    dmp_leases: FleetLeases | None = None
    """The fleet's run-time DMP leases and their revocations (with ``backbone``)."""

    membership: Membership | None = None
    """The fleet as this node sees it (with ``backbone``)."""
    streams: StreamOwnership | None = None
    """Which node owns each stream of the embedded log (with ``backbone``)."""

    def __init__(
        self, config: GatewayConfig, reactor: Any, metrics: GatewayMetrics, router: Router
    ) -> None:
        super().__init__()
        self.config = config
        self.reactor = reactor
        self.metrics = metrics
        self.router = router
        self.endpoints: dict[str, _Endpoint] = {}
        self.admin: ListenerService | None = None
        self.store: LogStore | None = None
        self.durable: DurableRoutes | None = None
        self.feeds: list[StreamRouteFeeds] = []

    def startService(self) -> None:
        """Recover the log, bind routes, start everything, then forward from the log.

        One ``ready`` line is logged once every listener listens. What the
        configuration exposes (`insecure_settings`) is logged first, as warnings.
        """
        for warning in insecure_settings(self.config):
            self._log.warn("msggateway: INSECURE: {warning}", warning=warning)
        if self.store is not None:
            self.store.open()  # recovery: before anything listens or is delivered
            if self.config.log.record_outcomes:
                self._record_outcomes(self.store)
        self.router.replace_table(self._bind(self.config.routes))
        super().startService()
        if self.durable is not None:
            self.durable.start()
        for feed in self.feeds:
            feed.start()
        self.when_listening().addCallbacks(self._ready, self._failed)

    def _record_outcomes(self, store: LogStore) -> None:
        stream = store.get(OUTCOME_STREAM) or store.create(OUTCOME_STREAM)
        recorder = OutcomeRecorder(stream, self.reactor)
        self.router.recorder = recorder
        if self.durable is not None:
            self.durable.recorder = recorder

    def stopService(self) -> Deferred[None]:
        """Drain, then stop forwarding and everything else, then close the log.

        The drain (`_drain`) answers what was read before anything closes,
        within ``shutdown_grace_seconds``; then the durable forwarders stop
        (what they were delivering is delivered again at the next start),
        the upstreams and remaining listeners stop, the outcome records of
        the last moments are written, and the log closes.
        """
        tell_systemd({"STOPPING": "1"})
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        await self._drain()
        if self.durable is not None:
            self.durable.stop()
        stopped: Deferred[Any] | None = super().stopService()
        if stopped is not None:
            await stopped
        store = self.store
        if store is None:
            return
        recorder = self.router.recorder
        if recorder is not None:
            recorder.flush()  # the records of the last moments, before the log closes
        await store.close()

    async def _drain(self) -> None:
        """Stop taking messages; answer what was read; close the connections, within the grace.

        1. Stop listening on the TCP listeners and reading their
           connections, stop the stream listeners' route feeds, and have
           the router take nothing more (a ZeroMQ listener, still bound so
           that its answers go out, is answered retry later; an upstream's
           messages are left to its server, unanswered).
        2. Wait until the router has answered every batch it took: a direct
           route's destination answered, a durable route's commit is done.
        3. Close every connection gracefully (its answers are written
           first) and wait for all to go.

        Both waits together take ``shutdown_grace_seconds`` at most; what is
        unanswered then learns it the way its protocol allows when its
        connection closes (a QMQP sender retries what got no reply).
        """
        grace = self.config.shutdown_grace_seconds
        started = self._now()
        factories = list(  # a worker's stream listener serves two ports
            dict.fromkeys(
                svc.factory
                for svc in self.listeners().values()
                if isinstance(svc.factory, ListenerFactory)
            )
        )
        connections = sum(len(factory.connections) for factory in factories)
        self._log.info(
            "msggateway stopping: no longer listening or reading; answering what {connections}"
            " connection(s) sent, then closing them, within {grace:g} s (shutdown_grace_seconds)",
            connections=connections,
            grace=grace,
        )
        for service in self.listeners().values():
            if isinstance(service.factory, ListenerFactory):
                service.stop_listening()
        for factory in factories:
            factory.stop_reading()
        for feed in self.feeds:
            feed.stop()
        upstreams = {name for name, endpoint in self.endpoints.items() if endpoint.upstream}
        self.router.stop_taking(unanswered=upstreams)
        await self._wait(self.router.when_idle(), started + grace)
        batches = self.router.batches_in_flight
        closing = [factory.close_connections() for factory in factories]
        await self._wait(DeferredList(closing, consumeErrors=True), started + grace)
        still_open = sum(len(factory.connections) for factory in factories)
        took = self._now() - started
        if not batches and not still_open:
            self._log.info(
                "msggateway drained in {seconds:.2f} s: everything read was answered,"
                " {connections} connection(s) closed",
                seconds=took,
                connections=connections,
            )
            return
        self._log.warn(
            "msggateway drain cut short by shutdown_grace_seconds ({grace:g} s) after"
            " {seconds:.2f} s: {batches} batch(es) still unanswered (their senders retry),"
            " {open} of {connections} connection(s) still open (dropped at exit)",
            grace=grace,
            seconds=took,
            batches=batches,
            open=still_open,
            connections=connections,
        )

    async def _wait(self, waited: Deferred[Any], deadline: float) -> None:
        """Wait for ``waited``, until ``deadline`` at most: then it is cancelled."""
        if waited.called:
            await waited
            return
        timer = self.reactor.callLater(max(deadline - self._now(), 0.0), waited.cancel)
        try:
            await waited
        except CancelledError:
            pass  # the grace ran out; the caller looks at what is left
        finally:
            if timer.active():
                timer.cancel()

    def _now(self) -> float:
        """The reactor's time (0 with a reactor that keeps none, such as a test's)."""
        if IReactorTime.providedBy(self.reactor):
            return float(self.reactor.seconds())
        return 0.0

    def _bind(self, routes: tuple[Route, ...]) -> RouteTable:
        durable = self.durable.delivery if self.durable is not None else None
        table = bind_routes(routes, self._destinations(), durable)
        if self.durable is not None:
            self.durable.retire({route.name for route in routes if route.durable})
        return table

    def listeners(self) -> dict[str, ListenerService]:
        """Every listener service (admin included), by name."""
        return {str(svc.name): svc for svc in self if isinstance(svc, ListenerService)}

    def when_listening(self) -> Deferred[dict[str, str]]:
        """Fire with ``{name: "host:port"}`` once all listeners listen."""
        services = list(self.listeners().values())
        waits = [svc.listening for svc in services if svc.listening is not None]
        done: Deferred[Any] = DeferredList(waits, fireOnOneErrback=True, consumeErrors=True)

        def addresses(_: object) -> dict[str, str]:
            return {str(svc.name): svc.address or "?" for svc in services}

        return done.addCallback(addresses)

    def _ready(self, addresses: dict[str, str]) -> None:
        text = " ".join(f"{name}={address}" for name, address in addresses.items())
        self._log.info("msggateway ready: {addresses}", addresses=text, listening=addresses)
        tell_systemd({"READY": "1", "STATUS": f"listening: {text}"})

    def _failed(self, failure: Failure) -> None:
        error = failure.value
        inner = getattr(error, "subFailure", None)
        reason = inner.getErrorMessage() if inner is not None else failure.getErrorMessage()
        self._log.critical("msggateway cannot start: a listener failed: {reason}", reason=reason)
        if IReactorCore.providedBy(self.reactor) and self.reactor.running:
            self.reactor.stop()

    def health(self) -> HealthReport:
        """What /healthz reports."""
        listening = {name: svc.port is not None for name, svc in self.listeners().items()}
        upstreams = {
            name: endpoint.healthy()
            for name, endpoint in self.endpoints.items()
            if endpoint.upstream
        }
        fleet, problem = self.membership.health() if self.membership else (None, None)
        return HealthReport(
            listeners=listening, upstreams=upstreams, fleet=fleet, fleet_problem=problem
        )

    def reload(self) -> bool:
        """Re-read secrets, listener certificates and route files; connections stay up.

        The secrets file and every ``mtls:`` listener's certificate, key and
        client CAs are read again first (new logins and new connections use
        them; established ones keep what they have); each that fails keeps
        its old contents, with the problem logged.

        Returns:
            Whether the new routes were taken; on any problem the old routes
            stay and every problem is logged.
        """
        self._reload_secrets()
        for where, problem in reload_server_tls():
            if problem is None:
                self._log.info(
                    "reload: {where}: new connections use the files as they are now", where=where
                )
            else:
                self._log.error(
                    "reload: {where}: keeping the old certificate: {problem}",
                    where=where,
                    problem=problem,
                )
        try:
            routes = reload_routes(self.config)
            if self.durable is None and any(route.durable for route in routes):
                raise ValueError(
                    "durable routes need the embedded log, which this gateway did not open"
                    " (it opens it when started with a durable route or a stream listener)"
                )
            table = self._bind(routes)
        except (ConfigError, ValueError) as exc:
            self._log.error("reload refused, keeping the old routes:\n{problems}", problems=exc)
            return False
        self.router.replace_table(table)
        for feed in self.feeds:
            feed.refresh()
        self._log.info("reload: {count} route(s) in effect", count=len(routes))
        return True

    def _reload_secrets(self) -> None:
        try:
            secrets = reload_secrets(self.config)
        except ConfigError as exc:
            self._log.error("reload: keeping the old secrets:\n{problems}", problems=exc)
            return
        if secrets is not None:
            self.config.secrets.update(secrets)
            self._log.info("reload: secrets re-read from {path}", path=self.config.secrets_path)

    def _destinations(self) -> Mapping[str, IDestination]:
        return {name: endpoint.destination for name, endpoint in self.endpoints.items()}


# --- per-protocol builders ------------------------------------------------------------


def _ssmp_listener(
    gateway: GatewayService, config: ListenerConfig
) -> tuple[IProtocolFactory, IDestination]:
    hub = Hub(config.name, gateway.reactor)
    if gateway.backbone is not None:
        FleetHub(hub, gateway.backbone, gateway.reactor)  # becomes hub.fleet
    factory = SSMPServerFactory(
        name=config.name,
        settings=config.settings,
        hub=hub,
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
    )
    return factory, hub


def _ssmp_upstream(
    gateway: GatewayService, config: UpstreamConfig
) -> tuple[IService, IDestination, Callable[[], bool]]:
    def route_topics() -> list[str]:
        # Exact topics of routes from this upstream are subscribed to as well.
        return [
            bound.route.pattern.text
            for bound in gateway.router.table.routes
            if bound.route.source == config.name and bound.route.pattern.is_exact
        ]

    upstream = SSMPUpstream(
        name=config.name,
        settings=config.settings,
        endpoint=clientFromString(gateway.reactor, config.endpoint),
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        topics=route_topics,
        metrics=gateway.metrics,
        # The server keeps one connection per identifier: one node logs in with it.
        lock=_fleet_lock(gateway, config, config.settings.identity.encode() != SSMP_ANONYMOUS),
    )
    return upstream.service, upstream, lambda: upstream.connected or upstream.standby


def _qmqp_listener(
    gateway: GatewayService, config: ListenerConfig
) -> tuple[IProtocolFactory, IDestination]:
    factory = QMQPServerFactory(
        name=config.name,
        settings=config.settings,
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
    )
    return factory, _NoDelivery(config.name, "a QMQP listener")


def _frontend_listener(
    gateway: GatewayService, config: ListenerConfig
) -> tuple[IProtocolFactory, IDestination]:
    factory = FrontendServerFactory(
        name=config.name,
        settings=config.settings,
        backend=clientFromString(gateway.reactor, config.settings.backend),
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
    )
    return factory, _NoDelivery(config.name, "a TLS front-end")


def _qmqp_upstream(
    gateway: GatewayService, config: UpstreamConfig
) -> tuple[IService, IDestination, Callable[[], bool]]:
    upstream = QMQPUpstream(
        name=config.name,
        settings=config.settings,
        endpoint=clientFromString(gateway.reactor, config.endpoint),
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
    )
    return upstream.service, upstream, lambda: upstream.connected


def _stream_listener(
    gateway: GatewayService, config: ListenerConfig
) -> tuple[IProtocolFactory, IDestination]:
    store = gateway.store
    assert store is not None  # made by build_gateway when a stream listener exists
    factory = StreamServerFactory(
        name=config.name,
        settings=config.settings,
        store=store,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
    )
    destination = StreamDestination(config.name, store, count_error=factory.count_error)
    if gateway.streams is not None:
        tls = config.tls  # relays are TLS too, with the fleet's relay secret
        secrets = gateway.config.secrets
        fleet = StreamFleet(
            gateway.streams,
            connect_tls(gateway.reactor, config.endpoint) if tls else connect_tcp(gateway.reactor),
            tls=tls,
            relay_secret=lambda: secrets.fleet_relay_secret,
        )
        factory.join_fleet(fleet)
        destination.join_fleet(
            OwnerAppends(
                fleet=fleet,
                listener=config.name,
                clock=gateway.reactor,
                frame_max=config.settings.frame_max,
                virtual_host=min(config.settings.virtual_hosts),
            )
        )
    feeds = StreamRouteFeeds(config.name, store, gateway.router, gateway.reactor)
    factory.on_stream_created.append(feeds.stream_created)
    gateway.feeds.append(feeds)
    return factory, destination


def _dmp_listener(
    gateway: GatewayService, config: ListenerConfig
) -> tuple[IProtocolFactory, IDestination]:
    factory = DMPServerFactory(
        name=config.name,
        settings=config.settings,
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
    )
    if gateway.dmp_leases is not None and gateway.backbone and gateway.locks:
        fleet = FleetDMP(
            factory, gateway.dmp_leases, gateway.backbone, gateway.locks, gateway.reactor
        )
        factory.join_fleet(fleet)
    return factory, factory  # the feeds are its route destination


def _mtl_listener(
    gateway: GatewayService, config: ListenerConfig
) -> tuple[IProtocolFactory, IDestination]:
    host, port = zmq_bind_address(config.endpoint)
    server = MTLServer(
        name=config.name,
        settings=config.settings,
        host=host,
        port=port,
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        reactor=gateway.reactor,
        metrics=gateway.metrics,
    )
    server.authorization = config.authorization
    server.backlog = config.backlog
    server.flow = config.flow
    server.login_failures = config.login_failures
    return MTLEndpoint(server), server  # type: ignore[return-value]


def _mtl_upstream(
    gateway: GatewayService, config: UpstreamConfig
) -> tuple[IService, IDestination, Callable[[], bool]]:
    host, port = zmq_connect_address(config.endpoint)
    upstream = MTLUpstream(
        name=config.name,
        settings=config.settings,
        host=host,
        port=port,
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        reactor=gateway.reactor,
        metrics=gateway.metrics,
    )
    service = _StartStopService(config.name, upstream.start, upstream.stop)
    return service, upstream, lambda: upstream.connected


def _dmp_upstream(
    gateway: GatewayService, config: UpstreamConfig
) -> tuple[IService, IDestination, Callable[[], bool]]:
    upstream = DMPUpstream(
        name=config.name,
        settings=config.settings,
        endpoint=clientFromString(gateway.reactor, config.endpoint),
        router=gateway.router,
        secrets=gateway.config.secrets,
        clock=gateway.reactor,
        metrics=gateway.metrics,
        lock=_fleet_lock(gateway, config, config.settings.mode == "get"),  # a feed has one reader
    )
    return upstream.service, upstream, lambda: upstream.connected or upstream.standby


def _fleet_lock(gateway: GatewayService, config: UpstreamConfig, needed: bool) -> FleetLock | None:
    """The upstream's fleet lock, ``upstream.<name>``, if ``needed`` and in a fleet."""
    if gateway.locks is None or not needed:
        return None
    return gateway.locks.lock(f"upstream.{config.name}")


class _StartStopService(Service):
    """A service around something with start() and stop()."""

    def __init__(self, name: str, start: Callable[[], None], stop: Callable[[], Any]) -> None:
        self.setName(name)
        self._start = start
        self._stop = stop

    def startService(self) -> None:
        """Start it."""
        super().startService()
        self._start()

    def stopService(self) -> Any:
        """Stop it."""
        super().stopService()
        return self._stop()


def _stream_upstream(
    gateway: GatewayService, config: UpstreamConfig
) -> tuple[IService, IDestination, Callable[[], bool]]:
    def relocate(host: str, port: int) -> IStreamClientEndpoint:
        # Another node of the cluster, reached the way the locator is (TLS included).
        description = client_endpoint_at(config.endpoint, host, port)
        endpoint: IStreamClientEndpoint = clientFromString(gateway.reactor, description)
        return endpoint

    movable = config.endpoint.split(":", 1)[0] in ("tcp", "tls")
    upstream = StreamUpstream(
        name=config.name,
        settings=config.settings,
        endpoint=clientFromString(gateway.reactor, config.endpoint),
        router=gateway.router,
        secrets=gateway.config.secrets,
        node=gateway.node,
        clock=gateway.reactor,
        reactor=gateway.reactor,
        metrics=gateway.metrics,
        relocate=relocate if movable else None,
        lock=_fleet_lock(gateway, config, bool(config.settings.subscribe)),
    )
    return upstream.service, upstream, lambda: upstream.connected


def _log_store(config: GatewayConfig, reactor: Any) -> LogStore:
    settings = config.log
    return LogStore(
        config.data_dir / "log",
        reactor,
        fsync=FsyncPolicy[settings.fsync.upper()],
        fsync_interval_seconds=settings.fsync_interval_seconds,
        inline_max_bytes=settings.inline_commit_max_bytes,
        default_retention=Retention(
            max_bytes=settings.max_bytes,
            max_age_seconds=settings.max_age_seconds,
            max_segment_bytes=settings.segment_bytes,
        ),
    )


@implementer(IDestination)
class _NoDelivery:
    """The destination of a listener that cannot be delivered to."""

    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self._what = what

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Refuse: nothing on this listener takes routed messages."""
        refusal = Outcome.rejected(f"{self.name} is {self._what}, which routes cannot deliver to")
        return all_same(len(messages), refusal)


_LISTENERS: dict[
    str, Callable[[GatewayService, ListenerConfig], tuple[IProtocolFactory, IDestination]]
] = {
    "ssmp": _ssmp_listener,
    "qmqp": _qmqp_listener,
    "stream": _stream_listener,
    "dmp": _dmp_listener,
    "mtl": _mtl_listener,
    "frontend": _frontend_listener,
}
_UPSTREAMS: dict[
    str,
    Callable[[GatewayService, UpstreamConfig], tuple[IService, IDestination, Callable[[], bool]]],
] = {
    "ssmp": _ssmp_upstream,
    "qmqp": _qmqp_upstream,
    "stream": _stream_upstream,
    "dmp": _dmp_upstream,
    "mtl": _mtl_upstream,
}


def build_gateway(
    config: GatewayConfig,
    reactor: Any,
    node: str | None = None,
    *,
    reuse_port: bool = False,
    shared: GatewayConfig | None = None,
) -> GatewayService:
    """Build the gateway's service tree; nothing listens until it starts.

    Args:
        config: The validated configuration.
        reactor: The reactor to listen, connect and keep time with.
        node: This process's node id; None: `node_id` of the configuration.
        reuse_port: Listen on every listener's port (MTL's and the admin
            endpoint's aside) with SO_REUSEPORT, sharing it with other
            processes (`gateway.fleet.reuseport`): a worker of a supervisor.
        shared: The configuration as every node reads it, before a worker's
            own ports (its hash is compared across the fleet); ``config`` if None.

    Raises:
        ConfigError: Without ``node``, the data dir's node id file is not usable.
    """
    metrics = GatewayMetrics()
    # process_*: resident memory, CPU seconds, open files (etc/grafana-dashboard.json).
    ProcessCollector(registry=metrics.registry)
    router = Router(RouteTable(), reactor, metrics)
    gateway = GatewayService(config, reactor, metrics, router)
    gateway.node = node or node_id(config.fleet, config.data_dir)
    metrics.set_node(gateway.node)
    fleet = config.fleet
    if fleet.amqp:
        gateway.backbone = make_backbone(
            node=gateway.node,
            endpoints=fleet.amqp,
            vhost=fleet.vhost,
            heartbeat_seconds=fleet.heartbeat_seconds,
            username=config.secrets.fleet_username,
            password=config.secrets.fleet_password,
            reactor=reactor,
            metrics=metrics,
        )
        locks = gateway.locks = FleetLocks(
            gateway.backbone,
            reactor,
            lease_seconds=heartbeat_interval(fleet.heartbeat_seconds),
            metrics=metrics,
        )
        if any(listener.protocol == "dmp" for listener in config.listeners):
            revocations = Revocations(
                gateway.backbone, reactor, stale_after_seconds=fleet.unhealthy_after_seconds
            )
            gateway.dmp_leases = FleetLeases(config.secrets, revocations, reactor)
        # Before the listeners: it stops after them, once their drain is answered;
        # and once the upstreams released their locks (their offsets stored).
        stop_backbone = gateway.backbone.stop
        backbone = _StartStopService(
            "fleet",
            gateway.backbone.start,
            lambda: locks.stop().addCallback(lambda _: stop_backbone()),
        )
        backbone.setServiceParent(gateway)
    needs_log = any(route.durable for route in config.routes) or any(
        listener.protocol == "stream" for listener in config.listeners
    )
    if needs_log:
        store = gateway.store = _log_store(config, reactor)
        gateway.durable = DurableRoutes(
            store,
            reactor,
            encode=durable_entries,
            decode=lambda entry, offset, timestamp: message_from_entry(
                entry, stream="", timestamp=timestamp, offset=offset, address_from_to=True
            ),
            dead_letter=lambda stream, route: dead_letter_writer(store, stream, route),
        )
        metrics.durable_log(store, gateway.durable.forwarders)
    if gateway.backbone is not None:
        gateway.membership = Membership(
            gateway.backbone,
            reactor,
            config_hash=live_config_hash(shared or config, router),
            addresses=lambda: _advertised(gateway),
            unhealthy_after_seconds=fleet.unhealthy_after_seconds,
            stats=metrics.fleet(),
        )
        stream_listeners = [item.name for item in config.listeners if item.protocol == "stream"]
        gateway.streams = StreamOwnership(gateway.membership, stream_listeners, dict(fleet.streams))
    listening: Any = reactor
    if reuse_port:
        from gateway.fleet.reuseport import ReusePortListening

        listening = ReusePortListening(reactor)
    for listener in config.listeners:
        factory, destination = _LISTENERS[listener.protocol](gateway, listener)
        if isinstance(factory, ListenerFactory):
            factory.max_connections = listener.max_connections
            factory.max_connections_per_identity = listener.max_connections_per_identity
            factory.authorization = listener.authorization
            factory.frame_timeout_seconds = listener.frame_timeout_seconds
            factory.flow = listener.flow
            factory.login_failures = listener.login_failures
            factory.cert_identity = listener.cert_identity
        if isinstance(factory, MTLEndpoint):  # ZeroMQ sockets, not a Twisted endpoint
            endpoint: IStreamServerEndpoint = factory  # type: ignore[assignment]
        else:
            endpoint = serverFromString(listening, listener.listen_endpoint)
        own_port = getattr(listener.settings, "worker_port", None)  # a worker's stream listener
        service = ListenerService(listener.name, endpoint, factory, advertised=own_port is None)
        service.setServiceParent(gateway)
        if own_port is not None:
            own = serverFromString(reactor, endpoint_with_port(listener.listen_endpoint, own_port))
            ListenerService(f"{listener.name}{WORKER_PORT_SUFFIX}", own, factory).setServiceParent(
                gateway
            )
        gateway.endpoints[listener.name] = _Endpoint(
            listener.name, destination, service, lambda: True, upstream=False
        )
    if gateway.membership is not None:
        # After the listeners: it announces where they are, and says goodbye before they stop.
        members = _StartStopService(
            "fleet-members", gateway.membership.start, gateway.membership.stop
        )
        members.setServiceParent(gateway)
    for upstream in config.upstreams:
        client, destination, healthy = _UPSTREAMS[upstream.protocol](gateway, upstream)
        client.setServiceParent(gateway)
        gateway.endpoints[upstream.name] = _Endpoint(
            upstream.name, destination, client, healthy, upstream=True
        )
    if config.admin.endpoint is not None:
        dmp_listeners = {
            name: endpoint.destination
            for name, endpoint in gateway.endpoints.items()
            if isinstance(endpoint.destination, DMPServerFactory)
        }
        site = make_admin_site(
            metrics=metrics,
            router=router,
            health=gateway.health,
            reactor=reactor,
            leases=LeaseDesk(dmp_listeners, config.secrets, reactor) if dmp_listeners else None,
            secrets=config.secrets,
            allowed_hosts=config.admin.allowed_hosts,
            gateway=gateway,
        )
        gateway.admin = ListenerService(
            "admin", serverFromString(reactor, config.admin.endpoint), site
        )
        gateway.admin.setServiceParent(gateway)
    return gateway


def _advertised(gateway: GatewayService) -> dict[str, tuple[str, int]]:
    """Each listening listener's advertised address (a stream listener's is its Metadata's)."""
    found: dict[str, tuple[str, int]] = {}
    for name, service in gateway.listeners().items():
        if service.port is None or name.endswith(WORKER_PORT_SUFFIX):
            continue
        advertised = getattr(service.factory, "advertised", None)
        if advertised is not None:
            host, port = advertised()
        else:
            bound = service.port.getHost()
            host, port = getattr(bound, "host", ""), getattr(bound, "port", 0)
        if port:
            found[name] = (str(host), int(port))
    return found


# --- twistd ------------------------------------------------------------------------------------


class Options(usage.Options):
    """Command-line options of ``twistd msggateway``."""

    optParameters = [
        ["config", "c", None, "Main configuration file (default: the embedded loopback default)."],
        [
            "log-format",
            None,
            "text",
            "text (twistd's lines) or json (one JSON object per line, with listener,"
            " route, peer and identity as fields), to stdout or twistd's --logfile.",
        ],
        [
            "worker",
            None,
            None,
            "Run as worker I of a supervisor ([fleet] processes): the supervisor passes it.",
            int,
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self.shared_ports: dict[str, int] = {}

    def opt_shared_port(self, value: str) -> None:
        """NAME=PORT: the port the supervisor holds for listener NAME (with --worker)."""
        name, equals, port = value.partition("=")
        if not equals or not port.isdigit() or int(port) > 65535:
            raise usage.UsageError(f"--shared-port {value}: expected NAME=PORT")
        self.shared_ports[name] = int(port)

    def postOptions(self) -> None:
        """Choose the log format; load and validate the configuration before anything starts."""
        # twistd reads its --logger after this (see gateway.logformat).
        select_log_format(self["log-format"], getattr(self, "parent", None))
        path = self["config"]
        try:
            self.gateway_config = load_config(Path(path)) if path else load_default_config()
            self.node = node_id(self.gateway_config.fleet, self.gateway_config.data_dir)
            provide_admin_token(self.gateway_config)
        except ConfigError as exc:
            raise usage.UsageError(
                "invalid configuration:\n" + "\n".join(f"  {p}" for p in exc.problems)
            ) from None
        worker = self["worker"]
        processes = self.gateway_config.fleet.processes
        if worker is None:
            return
        if not 0 <= worker < processes:
            raise usage.UsageError(
                f"--worker {worker}: [fleet] processes = {processes} has workers 0 to"
                f" {processes - 1}"
            )
        from gateway.fleet.worker import worker_data_dir

        data_dir = worker_data_dir(self.gateway_config.data_dir, worker)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise usage.UsageError(f"cannot create {data_dir}: {exc.strerror}") from None


GC_THRESHOLDS: Final = (10_000, 50, 100)
"""Generation thresholds of the cyclic garbage collector while the gateway runs."""


def tune_garbage_collector() -> None:
    """Keep the cyclic garbage collector off the per-message path.

    Every message allocates a few dozen short-lived containers (Deferreds,
    tuples, the Message itself); with Python's default thresholds (700, 10,
    10) the collector then runs every few messages and a full collection
    walks every object the process made at start-up (Twisted, the config,
    the log's index). Freezing what exists once the gateway is built takes
    those out of every later collection, and larger thresholds make
    collections rarer. Measured with bench/ssmp_to_rabbitmq.py: SSMP MCAST
    through the gateway into RabbitMQ went from 13.8k to 34.5k msg/s.
    Reference cycles are still collected, just in larger batches.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard limit, so max_connections is reachable.

    Every connection is a file descriptor; a soft limit of 1,024 (a common
    default) stops a listener long before its ``max_connections``. Returns
    the limit before and after (the same when it could not be raised).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return soft, soft
    return soft, hard


def _reload_on_hangup(reactor: Any, reload: Callable[[], object]) -> None:
    """Call ``reload`` in the reactor's thread on every SIGHUP."""
    if not hasattr(signal, "SIGHUP"):
        return

    def on_hangup(signum: int, frame: object) -> None:
        reactor.callFromThread(reload)

    signal.signal(signal.SIGHUP, on_hangup)


def makeService(options: Options) -> IService:
    """Build the gateway for twistd, on the global reactor.

    With ``[fleet] processes`` above 1 that is the supervisor of the
    workers; with ``--worker I``, worker I (see the module docstring).
    """
    from twisted.internet import reactor as _reactor

    reactor: Any = _reactor

    config: GatewayConfig = options.gateway_config
    shared = config  # what every node reads, before a worker's own ports
    node: str = options.node
    worker: int | None = options["worker"]
    if worker is None and config.fleet.processes > 1:
        from gateway.fleet.supervisor import make_supervisor

        supervisor = make_supervisor(
            config,
            node,
            Path(options["config"]),
            options["log-format"],
            getattr(options, "parent", None),
            reactor,
        )
        _reload_on_hangup(reactor, supervisor.reload)
        return supervisor
    if worker is not None:
        from gateway.fleet import worker as fleet_worker
        from gateway.logformat import tag_lines

        node = worker_node(node, worker)
        tag_lines(node)
        fleet_worker.leave_process_group()
        config = fleet_worker.worker_config(config, worker, options.shared_ports)
    gateway = build_gateway(config, reactor, node, reuse_port=worker is not None, shared=shared)
    if worker is not None:
        fleet_worker.SupervisorLink(gateway, reactor, worker).setServiceParent(gateway)
    tune_garbage_collector()
    before, after = raise_open_file_limit()
    if config.source != DEFAULT_CONFIG_NAME:
        _reload_on_hangup(reactor, gateway.reload)
    Logger().info(
        "msggateway starting as node {node} with {summary}"
        " (Python {python}; open files: {files}{raised})",
        node=gateway.node,
        summary=config.summary(),
        python=sys.version.split()[0],
        files=after,
        raised=f", raised from {before}" if after != before else "",
    )
    return gateway
