"""Log events as JSON lines: ``twistd msggateway --log-format json``.

Each event becomes one JSON object on one line: ``time`` (ISO 8601, UTC,
milliseconds), ``level``, ``namespace``, ``message`` (the event's format
string filled in, as the text log shows it), then the fields the gateway's
log calls pass that an operator filters on (`FIELDS`: ``listener``,
``route``, ``upstream``, ``peer``, ``identity``, ``stream``, ``reason``
and so on) as top-level keys, and ``traceback`` when the event carries a
failure. A message spanning lines stays on one (JSON escapes the line
breaks), so a log shipper never has to join lines.

twistd chooses its log observer before the gateway is built: from its own
``--logger`` option (a zero-argument factory, by qualified name), else
from ``--logfile``. `select_log_format` (called while the plugin's options
are parsed, before twistd reads its own) names `json_observer` as that
factory and notes where twistd would have written, so that JSON goes to
the same place text would: stdout under ``--nodaemon`` or with
``--logfile=-``, else the log file (reopened on SIGUSR1, as twistd does).
``twistd --logger gateway.logformat.json_observer`` works too and writes
to stdout.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, Protocol

import attrs
from twisted.logger import ILogObserver, LogEvent, formatEvent
from twisted.python import logfile, usage
from twisted.python.failure import Failure
from zope.interface import implementer

__all__ = [
    "FIELDS",
    "LOG_FORMATS",
    "JSONLinesObserver",
    "LogDestination",
    "event_as_json",
    "json_observer",
    "select_log_format",
]

LOG_FORMATS: Final = ("text", "json")
"""What ``--log-format`` takes; text (twistd's own format) is the default."""

FIELDS: Final = frozenset(
    {
        # where: the gateway's own names for its parts
        "listener",
        "upstream",
        "route",
        "stream",
        "sink",
        "feed",
        "resource",
        "topic",
        "source",
        "destination",
        "target",
        "backend",
        "path",
        "where",
        "address",
        "addresses",
        "listening",
        # who
        "peer",
        "identity",
        "user",
        "username",
        "sender",
        "role",
        "host",
        "port",
        # what happened
        "reason",
        "why",
        "problem",
        "problems",
        "error",
        "detail",
        "code",
        "kind",
        "action",
        "answer",
        # how much
        "count",
        "seconds",
        "limit",
        "backlog",
        "attempts",
        "failures",
        "free_bytes",
        "offset",
        "reference",
        "chunk_id",
        "segments",
    }
)
"""Event keys copied into the JSON object when a log call passes them."""

_RESERVED: Final = frozenset({"time", "level", "namespace", "message", "traceback"})
assert not FIELDS & _RESERVED


def _iso_time(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.fromtimestamp(seconds, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _plain(value: object) -> Any:
    """A JSON-ready copy of a field's value; anything unusual becomes its text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(item) for item in value]
    host, port = getattr(value, "host", None), getattr(value, "port", None)
    if isinstance(host, str) and isinstance(port, int):  # an IAddress
        return f"{host}:{port}"
    return str(value)


def event_as_json(event: LogEvent) -> str:
    """One log event as one line of JSON (no line break at the end).

    Args:
        event: A twisted.logger event (legacy ``twisted.python.log`` events
            included: they reach observers with a ``log_format``).
    """
    record: dict[str, Any] = {
        "time": _iso_time(event.get("log_time")),
        "level": getattr(event.get("log_level"), "name", "info"),
        "namespace": event.get("log_namespace", "-"),
        "message": formatEvent(event),
    }
    for key, value in event.items():
        if key in FIELDS:
            record[key] = _plain(value)
    failure = event.get("log_failure")
    if isinstance(failure, Failure):
        record["traceback"] = failure.getTraceback()
    return json.dumps(record, default=str)


class _TextFile(Protocol):
    def write(self, data: str, /) -> object: ...

    def flush(self) -> object: ...


@implementer(ILogObserver)
class JSONLinesObserver:
    """Writes each event as one JSON line to a text file, flushed per event.

    Args:
        out: Where the lines go (stdout, or a twistd `LogFile`).
    """

    def __init__(self, out: _TextFile) -> None:
        self._out = out

    def __call__(self, event: LogEvent) -> None:
        """Write one event."""
        self._out.write(event_as_json(event) + "\n")
        self._out.flush()


@attrs.frozen
class LogDestination:
    """Where twistd would have written its text log.

    Attributes:
        logfile: twistd's ``--logfile``: ``-`` for stdout, None or empty for
            its default (stdout under ``--nodaemon``, else ``twistd.log``).
        nodaemon: Whether twistd runs in the foreground.
    """

    logfile: str | None = "-"
    nodaemon: bool = True

    @property
    def stdout(self) -> bool:
        """Whether the log goes to stdout."""
        return self.logfile == "-" or (not self.logfile and self.nodaemon)


_destination = LogDestination()
"""Set by `select_log_format` while options are parsed; read once by `json_observer`."""


def select_log_format(log_format: str, twistd: usage.Options | None) -> None:
    """Make twistd log in ``log_format``: name `json_observer` as its ``--logger``.

    Args:
        log_format: One of `LOG_FORMATS`.
        twistd: twistd's own options (the plugin options' ``parent``), or
            None when the options are parsed outside twistd (then nothing
            is changed).

    Raises:
        usage.UsageError: An unknown format, or JSON asked for together with
            twistd options that choose another log (``--logger``,
            ``--syslog``) or with stdout for a daemon.
    """
    global _destination
    if log_format not in LOG_FORMATS:
        raise usage.UsageError(
            f"--log-format {log_format}: unknown; use one of {', '.join(LOG_FORMATS)}"
        )
    if log_format == "text" or twistd is None:
        return
    if twistd.get("logger"):
        raise usage.UsageError(
            "--log-format json chooses twistd's log observer itself; drop twistd's"
            f" --logger {twistd['logger']} or the --log-format option"
        )
    if twistd.get("syslog"):
        raise usage.UsageError(
            "--log-format json writes to stdout or --logfile, not to syslog; drop --syslog"
            " (under systemd, stdout goes to the journal)"
        )
    destination = LogDestination(twistd.get("logfile"), bool(twistd.get("nodaemon")))
    if destination.logfile == "-" and not destination.nodaemon:
        raise usage.UsageError(
            "--log-format json with --logfile=-: a daemon cannot log to stdout;"
            " add --nodaemon or name a log file"
        )
    _destination = destination
    twistd["logger"] = f"{__name__}.json_observer"


def json_observer() -> JSONLinesObserver:
    """The log observer factory twistd calls (``--logger``): JSON lines.

    Writes where twistd would have written text (`select_log_format`
    records it); stdout when used as ``twistd --logger`` directly.
    """
    destination = _destination
    if destination.stdout:
        # Taken now, before twistd points sys.stdout into the log itself.
        return JSONLinesObserver(sys.stdout)
    log_file = logfile.LogFile.fromFullPath(destination.logfile or "twistd.log")
    if not signal.getsignal(signal.SIGUSR1):  # twistd's own rotation signal

        def rotate(signum: int, frame: object) -> None:
            from twisted.internet import reactor

            reactor.callFromThread(log_file.rotate)  # type: ignore[attr-defined]

        signal.signal(signal.SIGUSR1, rotate)
    return JSONLinesObserver(log_file)
