"""The principal AMQP 0-9-1 connection of a DMP listener: where clients get their leases.

DMP connections are forked off an AMQP connection (spec
../shared/specs/dmp.txt, "Operations" and the Direct class in its
appendix). A DMP listener takes both on one port, told apart by the fifth
octet of the protocol header: ``AMQP 0 0 9 1`` is AMQP 0-9-1, ``AMQP 10 1 0
1`` DMP. The principal dialog::

    C: AMQP 0 0 9 1
    S: Connection.Start   server-properties {product, direct = 1}, PLAIN
    C: Connection.Start-Ok  PLAIN "NUL identity NUL secret"
    S: Connection.Tune    (or Connection.Close 403 ACCESS_REFUSED)
    C: Connection.Tune-Ok, Connection.Open
    S: Connection.Open-Ok
    C: Channel.Open       S: Channel.Open-Ok
    C: Direct.Put "sink"  S: Direct.Put-Ok "lease"   (Get / Get-Ok for a feed)

Only identities named in the listener's ``principals`` may log in (their
secret is in the secrets file's ``[logins]``). A refused login is answered
after the listener's `LoginRefusals` wait, and a Start-Ok arriving while its
address or identity still owes one is checked when it is over; nothing
more is read meanwhile. A Put or Get names one of the
listener's sinks or feeds (else Channel.Close 404 NOT_FOUND; a feed that
already has its reader gets 405 RESOURCE_LOCKED) and is granted a lease
valid for ``principal_lease_seconds``, made as the admin API's leases are
(`DMPServerFactory.issue_lease`: in a fleet, a signed text every node
accepts).

Spec ambiguity: the spec says the server announces ``direct = 1`` "when
sending a Connection.Start-Ok response", but Start-Ok is the client's; the
server-properties table it names belongs to Connection.Start, so that is
where we put it.

The server proposes heartbeat 0 (a principal connection is short-lived);
a client whose Tune-Ok asks for heartbeats anyway gets a heartbeat frame
every that many seconds, and is closed (without Close, as AMQP 0-9-1
section 4.2.7 says) after two intervals with nothing from it. The
handshake time-out of the listener bounds the time to log in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Protocol, cast

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.codecs import amqp091
from gateway.codecs.amqp091 import Method
from gateway.core.auth import Secrets
from gateway.core.authorization import Action
from gateway.protocols.dmp.settings import DMPListenerSettings
from gateway.protocols.logins import UNCHECKED, LoginRefusals

__all__ = ["CHANNEL_MAX", "PrincipalConnection", "PrincipalListener"]


class PrincipalListener(Protocol):
    """What a principal connection needs of its DMP listener (`DMPServerFactory` is one)."""

    name: str
    settings: DMPListenerSettings
    secrets: Secrets
    clock: IReactorTime

    @property
    def readers(self) -> Mapping[str, object]:
        """The feeds that have a reader now."""

    @property
    def logins(self) -> LoginRefusals:
        """The listener's refused logins."""

    def count_error(self, kind: str) -> None:
        """Count a protocol error of some kind."""

    def authorized(
        self, action: Action, identity: str | None, address: str, peer: object = None
    ) -> bool:
        """Whether ``identity`` may publish to or consume from ``address`` here."""

    def issue_lease(
        self, kind: str, target: str, expires: float, identity: str | None, *, certified: bool
    ) -> str:
        """Make a run-time lease and return its text.

        Raises:
            ValueError: It cannot be made (in a fleet: too long for a DMP lease).
        """


CHANNEL_MAX: Final = 16
"""Channels a principal connection may open (it needs one)."""
ACCESS_REFUSED: Final = 403
NOT_FOUND: Final = 404
NOT_ALLOWED: Final = 530
RESOURCE_LOCKED: Final = 405
CHANNEL_ERROR: Final = 504


class PrincipalConnection:
    """One principal AMQP 0-9-1 connection, after its protocol header.

    Args:
        factory: The DMP listener (settings, secrets, leases, feed readers).
        write: Writes bytes to the peer.
        close: Closes the connection, with a reason for the log.
        opened: Called once the connection is open (the handshake is over).
        wait: ``wait(seconds, then)`` stops reading the peer, and calls
            ``then`` after ``seconds`` (unless the connection ends first)
            and reads again.
        peer: The peer's address (where refused logins count).
    """

    _log = Logger()

    def __init__(
        self,
        factory: PrincipalListener,
        write: Callable[[bytes], None],
        close: Callable[[str], None],
        opened: Callable[[], None],
        wait: Callable[[float, Callable[[], None]], None],
        peer: object,
    ) -> None:
        self._factory = factory
        self._write = write
        self._close = close
        self._opened = opened
        self._wait = wait
        self._peer = peer
        self._waiting = False
        """A login waits (`LoginRefusals`); what is read meanwhile is held."""
        self._held: tuple[list[amqp091.Event], amqp091.AMQPError | None] = ([], None)
        self._waited = False
        """The Start-Ok waited once: if a wait is still owed, it is refused unchecked."""
        self._codec = amqp091.FrameCodec(amqp091.MIN_FRAME_MAX)
        self._stage = "start-ok"
        self._identity = ""
        self._channels: set[int] = set()
        self._closing_channels: set[int] = set()
        self._done = False
        self._heartbeat_seconds = 0
        self._heard_at = factory.clock.seconds()
        self._timer: IDelayedCall | None = None
        """The next heartbeat we send."""
        self._silence: IDelayedCall | None = None
        """The next look at the peer's silence (two heartbeat intervals allowed)."""

    def start(self) -> None:
        """Answer the protocol header with Connection.Start."""
        self._send(
            0,
            "connection.start",
            version_major=0,
            version_minor=9,
            server_properties={
                "product": "msggateway",
                "direct": 1,
                "capabilities": {},
            },
            mechanisms=b"PLAIN",
            locales=b"en_US",
        )

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an incomplete frame (for the listener's frame time-out)."""
        return self._codec.pending_bytes

    def receive_data(self, data: bytes) -> None:
        """Handle what the peer sent."""
        if self._done:
            return
        self._heard_at = self._factory.clock.seconds()
        try:
            events = self._codec.receive_data(data)
        except amqp091.AMQPError as exc:
            self._handle_events(cast(list[amqp091.Event], exc.events), exc)
            return
        self._handle_events(events, None)

    def _handle_events(self, events: list[amqp091.Event], error: amqp091.AMQPError | None) -> None:
        """Handle frames in order, then a framing error; a waiting login holds the rest."""
        for index, event in enumerate(events):
            self._handle(event)
            if self._done:
                return
            if self._waiting:
                self._held = (events[index + 1 :], error)
                return
        if error is not None:
            self._factory.count_error(error.kind)
            self._fail(error.code, error.reason, error.class_id, error.method_id)

    # --- dispatch ------------------------------------------------------------------------

    def _handle(self, event: amqp091.Event) -> None:
        if isinstance(event, amqp091.HeartbeatFrame):
            return
        name = event.name
        if name == "connection.close":
            self._send(0, "connection.close-ok")
            self._finish("the client closed the principal connection")
        elif name.startswith("connection."):
            self._connection_method(event)
        elif self._stage != "open":
            self._fail(amqp091.COMMAND_INVALID, f"{name} before the connection is open", *event.ids)
        elif event.channel == 0:
            self._fail(CHANNEL_ERROR, f"{name} on channel 0, the connection's", *event.ids)
        elif event.channel in self._closing_channels:
            # We closed it: wait for Close-Ok (a Close crossing ours is answered), drop the rest.
            if name in ("channel.close-ok", "channel.close"):
                self._closing_channels.discard(event.channel)
            if name == "channel.close":
                self._send(event.channel, "channel.close-ok")
        elif name == "channel.open":
            self._channel_open(event)
        elif event.channel not in self._channels:
            self._fail(CHANNEL_ERROR, f"{name} on channel {event.channel}, not open", *event.ids)
        elif name == "channel.close":
            self._channels.discard(event.channel)
            self._send(event.channel, "channel.close-ok")
        elif name in ("direct.put", "direct.get"):
            self._lease(event)
        else:
            self._fail(amqp091.COMMAND_INVALID, f"a client does not send {name}", *event.ids)

    def _connection_method(self, method: Method) -> None:
        # Each handshake method belongs to exactly one stage; nothing else comes before "open".
        expected = {
            "start-ok": "connection.start-ok",
            "tune-ok": "connection.tune-ok",
            "open-wait": "connection.open",
        }
        stage, name = self._stage, method.name
        if expected.get(stage) != name:
            wanted = expected.get(stage, "no connection method but Close")
            why = f"{name} is out of place here (expected {wanted})"
            self._fail(amqp091.COMMAND_INVALID, why, *method.ids)
        elif name == "connection.start-ok":
            self._log_in(method)
        elif name == "connection.tune-ok":
            frame_max = method.arguments["frame_max"]
            if frame_max and frame_max < amqp091.MIN_FRAME_MAX:
                self._fail(
                    amqp091.SYNTAX_ERROR, f"frame-max {frame_max} is under 4096", *method.ids
                )
                return
            self._stage = "open-wait"
            self._heartbeat_seconds = method.arguments["heartbeat"]
            if self._heartbeat_seconds:
                clock = self._factory.clock
                self._timer = clock.callLater(self._heartbeat_seconds, self._beat)
                self._silence = clock.callLater(2 * self._heartbeat_seconds, self._check_silence)
        else:  # connection.open
            self._stage = "open"
            self._send(0, "connection.open-ok", reserved_1="")
            self._opened()

    def _log_in(self, method: Method) -> None:
        mechanism = method.arguments["mechanism"]
        response: bytes = method.arguments["response"]
        parts = response.split(b"\0")
        identity = parts[1].decode("utf-8", "replace") if len(parts) == 3 else None
        logins = self._factory.logins
        wait = logins.wait_seconds(self._peer, identity)
        if wait > 0 and not self._waited:
            self._waited = True
            self._hold(wait, lambda: self._go_on([method]))
            return
        if wait > 0:
            self._refuse_login(identity, UNCHECKED, checked=False)
            return
        if mechanism != "PLAIN":
            self._refuse_login(identity, f"mechanism {mechanism!r} is not offered (PLAIN is)")
            return
        if identity is None:
            self._refuse_login(identity, "a PLAIN response is authzid NUL authcid NUL password")
            return
        password = parts[2]
        allowed = identity in self._factory.settings.principals
        # Verify even when not allowed, so that both take the same time.
        if not self._factory.secrets.verify(identity, password):
            self._refuse_login(identity, "wrong identity or secret")
            return
        if not allowed:
            self._refuse_login(identity, "not one of the listener's principals")
            return
        logins.accepted(identity)
        self._identity = identity
        self._stage = "tune-ok"
        self._send(0, "connection.tune", channel_max=CHANNEL_MAX, frame_max=4096, heartbeat=0)

    def _refuse_login(self, identity: str | None, why: str, *, checked: bool = True) -> None:
        """Refuse a Start-Ok: Connection.Close 403 once `LoginRefusals` says, then close."""
        self._factory.count_error("principal-refused")
        delay = self._factory.logins.refused(
            peer=self._peer, identity=identity, mechanism="AMQP PLAIN", why=why, checked=checked
        )
        # The reply text does not say which check failed.
        refusal = f"login refused for {identity!r}" if identity is not None else why
        if delay > 0:
            self._hold(delay, lambda: self._fail(ACCESS_REFUSED, refusal, 10, 11))
        else:
            self._fail(ACCESS_REFUSED, refusal, 10, 11)

    def _hold(self, seconds: float, then: Callable[[], None]) -> None:
        """Read nothing, and hold what was read, for ``seconds``; then call ``then``."""
        self._waiting = True

        def waited() -> None:
            self._waiting = False
            if not self._done:
                then()

        self._wait(seconds, waited)

    def _go_on(self, first: list[amqp091.Event]) -> None:
        """Handle ``first`` and then the frames held, as one read."""
        (events, error), self._held = self._held, ([], None)
        self._handle_events(first + events, error)

    def _channel_open(self, method: Method) -> None:
        channel = method.channel
        if channel in self._channels or channel > CHANNEL_MAX:
            self._fail(CHANNEL_ERROR, f"channel {channel} cannot be opened", *method.ids)
            return
        self._channels.add(channel)
        self._send(channel, "channel.open-ok", reserved_1=b"")

    def _lease(self, method: Method) -> None:
        factory = self._factory
        settings = factory.settings
        kind, field = ("sink", "sink") if method.name == "direct.put" else ("feed", "feed")
        target = method.arguments[field]
        known = settings.sinks if kind == "sink" else settings.feeds
        if target not in known:
            factory.count_error("not-found")
            self._close_channel(method, NOT_FOUND, f"no {kind} named {target!r}")
            return
        if kind == "feed" and target in factory.readers:
            factory.count_error("feed-busy")
            self._close_channel(method, RESOURCE_LOCKED, f"feed {target!r} already has a reader")
            return
        action = Action.PUBLISH if kind == "sink" else Action.CONSUME
        if not factory.authorized(action, self._identity, target):
            self._close_channel(
                method, ACCESS_REFUSED, f"{self._identity} may not {action.value} {target!r}"
            )
            return
        expires = factory.clock.seconds() + settings.principal_lease_seconds
        try:
            # The lease is the principal's: a DMP connection using it acts as that identity.
            text = factory.issue_lease(kind, target, expires, self._identity, certified=False)
        except ValueError as exc:
            self._close_channel(method, NOT_ALLOWED, f"no lease for {target!r}: {exc}")
            return
        self._log.info(
            "{listener}: lease for {kind} {target} granted to {identity}",
            listener=factory.name,
            kind=kind,
            target=target,
            identity=self._identity,
        )
        self._send(method.channel, method.name + "-ok", lease=text)

    # --- closing -------------------------------------------------------------------------

    def _close_channel(self, method: Method, code: int, text: str) -> None:
        class_id, method_id = method.ids
        self._channels.discard(method.channel)
        self._closing_channels.add(method.channel)
        self._send(
            method.channel,
            "channel.close",
            reply_code=code,
            reply_text=_short(text),
            class_id=class_id,
            method_id=method_id,
        )

    def _fail(self, code: int, reason: str, class_id: int = 0, method_id: int = 0) -> None:
        """Connection.Close with ``code``, then close the socket."""
        self._send(
            0,
            "connection.close",
            reply_code=code,
            reply_text=_short(reason),
            class_id=class_id,
            method_id=method_id,
        )
        self._log.info(
            "{listener}: principal connection closed with {code}: {reason}",
            listener=self._factory.name,
            code=code,
            reason=reason,
        )
        # Without waiting for Close-Ok: a peer that broke framing may never send it.
        self._finish(f"principal connection refused: {reason}")

    def _beat(self) -> None:
        self._timer = None
        if self._done:
            return
        self._write(amqp091.encode_heartbeat())
        self._timer = self._factory.clock.callLater(self._heartbeat_seconds, self._beat)

    def _check_silence(self) -> None:
        """Close a peer silent for two heartbeat intervals (AMQP 0-9-1, 4.2.7), to the second."""
        self._silence = None
        if self._done:
            return
        allowed = 2 * self._heartbeat_seconds
        silent = self._factory.clock.seconds() - self._heard_at
        if silent < allowed:
            self._silence = self._factory.clock.callLater(allowed - silent, self._check_silence)
            return
        self._factory.count_error("heartbeat-timeout")
        self._finish(f"principal connection silent for {silent:g} s (heartbeat {allowed // 2} s)")

    def stop(self) -> None:
        """The connection is gone: no more timers."""
        self._done = True
        for timer in (self._timer, self._silence):
            if timer is not None and timer.active():
                timer.cancel()
        self._timer = self._silence = None

    def _finish(self, why: str) -> None:
        self.stop()
        self._close(why)

    def _send(self, channel: int, name: str, **arguments: object) -> None:
        self._write(amqp091.encode_method(Method(channel=channel, name=name, arguments=arguments)))


def _short(text: str) -> str:
    """Cut a reply text to a short string (255 octets of UTF-8)."""
    return text.encode("utf-8")[:255].decode("utf-8", "ignore")
