"""Tell systemd how the gateway is doing: ``sd_notify`` for ``Type=notify`` units.

systemd passes a unix datagram socket in ``NOTIFY_SOCKET`` (a path, or an
abstract name written with a leading ``@``); a service writes newline
separated ``KEY=VALUE`` lines to it (sd_notify(3)). The gateway sends
``READY=1`` once every listener listens (with the ``msggateway ready`` log
line), so that ``systemctl start`` returns only then and units ordered
after it find the ports open, and ``STOPPING=1`` when it begins to stop.
Outside systemd (no ``NOTIFY_SOCKET``) nothing is sent. This is the few
lines of the protocol the gateway needs, not a dependency on libsystemd.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Final

from twisted.logger import Logger

__all__ = ["NOTIFY_SOCKET", "notify", "tell_systemd"]

NOTIFY_SOCKET: Final = "NOTIFY_SOCKET"
"""The environment variable systemd names its notification socket in."""

_log = Logger()


def _socket_address(value: str) -> str:
    """The address to send to: an abstract name (``@name``) starts with a NUL byte."""
    if value.startswith("@"):
        return "\0" + value[1:]
    return value


def notify(state: Mapping[str, str], environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` to systemd's notification socket, if there is one.

    The datagram is sent without blocking: the reactor never waits on
    systemd.

    Args:
        state: Keys and values, e.g. ``{"READY": "1", "STATUS": "..."}``.
        environ: Where ``NOTIFY_SOCKET`` is looked up (default `os.environ`).

    Returns:
        Whether a notification socket was named (and so the state sent).

    Raises:
        OSError: The socket was named but could not be sent to (gone,
            not a datagram socket, its queue full).
        ValueError: The socket is not a unix socket (``vsock:``) or a value
            holds a line break.
    """
    where = (os.environ if environ is None else environ).get(NOTIFY_SOCKET)
    if not where:
        return False
    if not where.startswith(("/", "@")):
        raise ValueError(f"{NOTIFY_SOCKET}={where}: only unix sockets are supported")
    for key, value in state.items():
        if "\n" in key or "\n" in value or "=" in key:
            raise ValueError(f"cannot send {key}={value!r} to systemd: one line per key")
    data = "".join(f"{key}={value}\n" for key, value in state.items()).encode("utf-8")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        sock.connect(_socket_address(where))
        sock.send(data)
    return True


def tell_systemd(state: Mapping[str, str], environ: Mapping[str, str] | None = None) -> None:
    """`notify`, logging (not raising) a failure: the gateway runs on regardless.

    Args:
        state: What to send (see `notify`).
        environ: Where ``NOTIFY_SOCKET`` is looked up (default `os.environ`).
    """
    try:
        notify(state, environ)
    except (OSError, ValueError) as exc:
        where = (os.environ if environ is None else environ).get(NOTIFY_SOCKET)
        _log.warn(
            "cannot tell systemd {what} through {path}: {reason}; under Type=notify systemd"
            " then times the start out (TimeoutStartSec): check the unit's NotifyAccess"
            " (main) and that twistd runs with --nodaemon",
            what=" ".join(f"{key}={value}" for key, value in state.items()),
            path=f"{NOTIFY_SOCKET}={where}",
            reason=exc,
        )
