"""An MTL listener's two ROUTER sockets, made ready to bind: limits, who may connect, CURVE.

Control and data are ROUTER sockets (spec, "Request and Reply Routing")
on one ZeroMQ context. What is set here, before either binds, so that no
peer gets in unasked:

* the data socket is ``ROUTER_MANDATORY`` (a command for a peer that is
  gone, or whose queue is full, fails instead of vanishing) with
  ``SNDHWM`` at ``max_backlog_messages``; both have the listener's
  ``backlog`` of pending connections;
* a ZAP handler (`gateway.protocols.mtl.zap`) on the context, asked about
  every peer of both sockets: the allow-lists, and a number for each
  connection, read from every message (`ZmqSocket.track_connection`);
* a `HandshakeWatch` on each socket: handshakes libzmq refused before ZAP,
  and connections that closed, taken in before each read burst of the
  control socket, before a data message from a connection not known yet
  (`ListenerSockets.look_at_connections`) and before each ZAP reply, so a
  closed connection is known before anything under its routing id, or on
  its file descriptor reused, is taken as another connection's;
* CURVE on both, with the listener's secret key, if it has one;
* the control socket reads each message's Peer-Address (where refused
  logins count) and, with ``curve_identities``, its ZAP User-Id (SASL
  EXTERNAL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.interfaces import IReactorTime

from gateway.protocols.mtl.settings import MTLListenerSettings

__all__ = ["ListenerSockets", "listener_sockets"]


@attrs.frozen
class ListenerSockets:
    """What `listener_sockets` made: the two sockets, and who watches their connections."""

    control: Any
    data: Any
    zap: Any
    watches: tuple[Any, ...]
    look_at_connections: Callable[[], None]
    """Take in what the watches saw (before a data peer not known yet is made)."""


def listener_sockets(
    factory: Any,
    *,
    listener: str,
    settings: MTLListenerSettings,
    backlog: int,
    clock: IReactorTime,
    control: tuple[Callable[[list[bytes]], None], Callable[[int], None]],
    data: tuple[Callable[[list[bytes]], None], Callable[[], None], Callable[[int], None]],
    count_error: Callable[[str], None],
) -> ListenerSockets:
    """Make a listener's control and data sockets, ready to bind.

    Args:
        factory: The listener's txzmq factory (`zmq_factory`).
        listener: The listener's name, for the log.
        settings: Its settings.
        backlog: Connections the kernel holds for each socket (``ZMQ_BACKLOG``).
        clock: For the refusals' log.
        control: The control socket's message handler, and what ends the
            session of a connection that closed (by file descriptor).
        data: The data socket's message handler, end-of-burst handler, and
            what forgets the peer of a connection that closed.
        count_error: Counts a protocol error of some kind.
    """
    import zmq

    from gateway.protocols.mtl.handshakes import HandshakeWatch, RefusalLog
    from gateway.protocols.mtl.zap import ZAPHandler, ZAPPolicy
    from gateway.protocols.mtl.zmq import ZmqSocket

    on_control, control_closed = control
    on_data, on_drained, data_closed = data
    control_socket = ZmqSocket(factory, zmq.ROUTER, on_control)
    data_socket = ZmqSocket(factory, zmq.ROUTER, on_data, on_drained)
    # A command for a peer that is gone or whose queue is full fails to send
    # instead of vanishing: a routed message then answers retry later rather
    # than counting as delivered.
    data_socket.set_option(zmq.ROUTER_MANDATORY, 1)
    # What waits for one data peer that does not read, at most (set before binding).
    data_socket.set_option(zmq.SNDHWM, settings.max_backlog_messages)
    if settings.curve_identities:
        control_socket.track_user_id()  # SASL EXTERNAL: the identity of the CURVE key
    control_socket.track_peer_address()  # where refused logins count
    refusals = RefusalLog(clock)
    watches: list[Any] = []

    def look_at_connections() -> None:
        for watch in watches:
            watch.read_now()

    # On the context before the sockets bind, so that no peer gets in unasked, and
    # every connection gets its number (sessions and data peers are bound to it).
    zap = ZAPHandler(
        factory,
        ZAPPolicy.from_settings(
            settings.allow_addresses, settings.curve_client_keys, settings.curve_identities
        ),
        listener,
        refusals,
        lambda _: count_error("peer-refused"),
        look_at_connections,
    )
    secret_key = settings.curve_secret_key
    for socket, which, closed in (
        (control_socket, "control", control_closed),
        (data_socket, "data", data_closed),
    ):
        socket.set_option(zmq.BACKLOG, backlog)  # ZeroMQ's default is 100
        socket.set_option(zmq.ZAP_DOMAIN, b"msggateway")
        socket.track_connection()
        watches.append(
            HandshakeWatch(
                socket,
                listener=listener,
                which=which,
                curve=secret_key is not None,
                refusals=refusals,
                count_error=count_error,
                on_closed=closed,
            )
        )
        if secret_key is not None:
            socket.set_option(zmq.CURVE_SERVER, 1)
            socket.set_option(zmq.CURVE_SECRETKEY, secret_key)
    # Connections that closed before a control read are known before it: a routing
    # id another connection took reads as that connection's. The data socket looks
    # only when a message comes from a connection it does not know (`DataPeers`):
    # a look before each read burst cost more than the rest of a small burst.
    control_socket.read_first(look_at_connections)
    return ListenerSockets(control_socket, data_socket, zap, tuple(watches), look_at_connections)
