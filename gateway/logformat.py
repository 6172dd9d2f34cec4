r"""The gateway's log lines, text or JSON, with peer input escaped.

``twistd msggateway --log-format text`` (the default) writes twistd's own
lines; ``--log-format json`` writes JSON lines. Either way a field's value
(peer input, mostly: a reason quoting its bytes, an identity, a topic) is
written with its control characters as visible escapes (``\x1b``,
``\r``, ``\n``: `escape_controls`), so that a peer can neither break a
line (and forge the next) nor drive the reader's terminal. The format
strings are the gateway's own and keep their line breaks; a traceback keeps
its lines (text continues them with a tab, as twistd does) with every other
control character escaped.

As JSON, each event is one object on one line: ``time`` (ISO 8601, UTC,
milliseconds), ``level``, ``namespace``, ``message`` (the event's format
string filled in, as the text log shows it), then the fields the gateway's
log calls pass that an operator filters on (`FIELDS`: ``listener``,
``route``, ``upstream``, ``peer``, ``identity``, ``stream``, ``reason``
and so on) as top-level keys, and ``traceback`` when the event carries a
failure. A message spanning lines stays on one (JSON escapes the line
breaks), so a log shipper never has to join lines.

The worker processes of one host (``[fleet] processes``) write their lines
to the same place; each tags its own with its node id (`tag_lines`): a
``node`` key in JSON, and in text the start of the system field
(``[gw-x-1,gateway.service#info]``, ``[gw-x-1,SSMPServerProtocol,3,127.0.0.1]``).

twistd chooses its log observer before the gateway is built: from its own
``--logger`` option (a zero-argument factory, by qualified name), else
from ``--logfile`` and ``--syslog``. `select_log_format` (called while the
plugin's options are parsed, before twistd reads its own) names
`json_observer` or `text_observer` as that factory and notes where twistd
would have written, so that the lines go where twistd's would: stdout under
``--nodaemon`` or with ``--logfile=-``, else the log file (reopened on
SIGUSR1, as twistd does), or syslog for text. An operator's own
``--logger`` is left alone under text (and refused with JSON).
``twistd --logger gateway.logformat.json_observer`` (or ``text_observer``)
works too and writes to stdout.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import IO, Any, Final, Protocol, cast

import attrs
from twisted.logger import (
    ILogObserver,
    LegacyLogObserverWrapper,
    LogEvent,
    formatEvent,
    textFileLogObserver,
)
from twisted.python import logfile, usage
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs.escaping import escape_controls

__all__ = [
    "FIELDS",
    "LOG_FORMATS",
    "EscapingObserver",
    "JSONLinesObserver",
    "LogDestination",
    "escaped_event",
    "escaped_message",
    "event_as_json",
    "json_observer",
    "select_log_format",
    "tag_lines",
    "text_observer",
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

_RESERVED: Final = frozenset({"time", "level", "namespace", "node", "message", "traceback"})
assert not FIELDS & _RESERVED


_node: str | None = None
"""The node id every line carries (`tag_lines`); None: lines carry none."""


def tag_lines(node: str | None) -> None:
    """Tag every line this process writes from now on with ``node`` (None: stop tagging).

    A worker of a supervisor calls it: its lines go where its siblings' go.
    """
    global _node
    _node = node


def _iso_time(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.fromtimestamp(seconds, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _plain(value: object) -> Any:
    """A JSON-ready copy of a field's value; anything unusual becomes its text.

    Text comes out with its control characters escaped (`escape_controls`).
    """
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, str):
        return escape_controls(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN
    if isinstance(value, bytes | bytearray | memoryview):
        return escape_controls(bytes(value).decode("utf-8", "backslashreplace"))
    if isinstance(value, Mapping):
        return {escape_controls(str(key)): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(item) for item in value]
    host, port = getattr(value, "host", None), getattr(value, "port", None)
    if isinstance(host, str) and isinstance(port, int):  # an IAddress
        return escape_controls(f"{host}:{port}")
    return escape_controls(str(value))


class _Escaped:
    """A field's value as the format string sees it: whatever it renders as, escaped.

    Twisted's formatting reaches into a field (``{peer.host}``,
    ``{items[0]}``, ``{describe()}``) before it renders it; each step gives
    another `_Escaped`, so that what lands in the message is escaped however
    it was reached.
    """

    __slots__ = ("_value",)

    def __init__(self, value: object) -> None:
        self._value = value

    def __format__(self, spec: str) -> str:
        return escape_controls(format(self._value, spec))

    def __str__(self) -> str:
        return escape_controls(str(self._value))

    def __repr__(self) -> str:
        return escape_controls(repr(self._value))

    def __getattr__(self, name: str) -> _Escaped:
        return _Escaped(getattr(self._value, name))

    def __getitem__(self, key: object) -> _Escaped:
        return _Escaped(self._value[key])  # type: ignore[index]

    def __call__(self) -> _Escaped:
        return _Escaped(self._value())  # type: ignore[operator]


def _legacy_failure(event: LogEvent) -> Failure | None:
    """The failure of a legacy ``log.err`` event, whose text would hold its traceback."""
    failure = event.get("failure")
    if event.get("isError") and not event.get("message") and isinstance(failure, Failure):
        return failure
    return None


def escaped_message(event: LogEvent) -> str:
    """The event's message as `formatEvent` gives it, each field's rendering escaped.

    The format string's own text (line breaks included) is kept: it is the
    gateway's, not a peer's. What the fields put into it never holds a
    control character.

    Args:
        event: A twisted.logger event (legacy ``twisted.python.log`` events
            included: they reach observers with a ``log_format``).
    """
    if "log_flattened" in event:  # rendered elsewhere already: no telling fields from format
        return escape_controls(formatEvent(event))
    if "log_failure" not in event and _legacy_failure(event) is not None:
        # log.err: its text is why + traceback; the traceback is kept apart.
        return escape_controls(str(event.get("why") or "Unhandled Error"))
    fields = {
        key: value if key == "log_format" else _Escaped(value) for key, value in event.items()
    }
    # Fields are escaped; this catches what else a message can hold (the
    # notice Twisted writes for an event it cannot format quotes the error).
    return escape_controls(formatEvent(fields), keep_newlines=True)


def _traceback(event: LogEvent) -> str | None:
    """The event's traceback, if it carries a failure: lines kept, anything else escaped."""
    failure = event.get("log_failure")
    if not isinstance(failure, Failure):
        failure = _legacy_failure(event)
        if failure is None:
            return None
    return escape_controls(failure.getTraceback().rstrip("\n"), keep_newlines=True)


def escaped_event(event: LogEvent) -> LogEvent:
    """A new event that any observer renders as ``event``, with peer input escaped.

    Its message is `escaped_message` followed by the escaped traceback, if
    any, as Twisted's text format would put it (and as a legacy observer
    such as syslog reads it): ``log_text`` under the format ``{log_text}``.
    Time, level, namespace and system (escaped, and led by the node id
    `tag_lines` set) are kept; other fields are not, since the message holds them.

    Args:
        event: A twisted.logger event.
    """
    text = escaped_message(event)
    traceback = _traceback(event)
    if traceback is not None:
        text = f"{text}\n{traceback}"
    escaped: LogEvent = {"log_format": "{log_text}", "log_text": text}
    for key in ("log_time", "log_level", "log_namespace"):
        if key in event:
            escaped[key] = event[key]
    system = event.get("log_system")
    if _node is not None:
        if system is None:  # what twistd would show: namespace#level
            level = getattr(event.get("log_level"), "name", "-")
            system = f"{event.get('log_namespace', '-')}#{level}"
        system = f"{_node},{system}"
    if system is not None:
        escaped["log_system"] = escape_controls(str(system))
    return escaped


def event_as_json(event: LogEvent) -> str:
    r"""One log event as one line of JSON (no line break at the end).

    The message and the fields have their control characters escaped
    (`escaped_message`, `escape_controls`); the traceback keeps its line
    breaks, which JSON writes as ``\n``.

    Args:
        event: A twisted.logger event (legacy ``twisted.python.log`` events
            included: they reach observers with a ``log_format``).
    """
    record: dict[str, Any] = {
        "time": _iso_time(event.get("log_time")),
        "level": getattr(event.get("log_level"), "name", "info"),
        "namespace": escape_controls(str(event.get("log_namespace", "-"))),
        "message": escaped_message(event),
    }
    if _node is not None:
        record["node"] = _node
    for key, value in event.items():
        if key in FIELDS:
            record[key] = _plain(value)
    traceback = _traceback(event)
    if traceback is not None:
        record["traceback"] = traceback
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


@implementer(ILogObserver)
class EscapingObserver:
    """Hands each event on to another observer as `escaped_event` rewrites it.

    Args:
        observer: What writes the lines (twistd's text file observer, or
            syslog's through `LegacyLogObserverWrapper`).
    """

    def __init__(self, observer: ILogObserver) -> None:
        self._observer = observer

    def __call__(self, event: LogEvent) -> None:
        """Pass one event on, escaped."""
        self._observer(escaped_event(event))


@attrs.frozen
class LogDestination:
    """Where twistd would have written its log.

    Attributes:
        logfile: twistd's ``--logfile``: ``-`` for stdout, None or empty for
            its default (stdout under ``--nodaemon``, else ``twistd.log``).
        nodaemon: Whether twistd runs in the foreground.
        syslog_prefix: twistd's ``--prefix`` when ``--syslog`` sends the
            text log to syslog; None otherwise.
    """

    logfile: str | None = "-"
    nodaemon: bool = True
    syslog_prefix: str | None = None

    @property
    def stdout(self) -> bool:
        """Whether the log goes to stdout."""
        return self.syslog_prefix is None and (
            self.logfile == "-" or (not self.logfile and self.nodaemon)
        )


_destination = LogDestination()
"""Set by `select_log_format` while options are parsed; read once by the observer factory."""


def select_log_format(log_format: str, twistd: usage.Options | None) -> None:
    """Make twistd log in ``log_format``: name our observer factory as its ``--logger``.

    Args:
        log_format: One of `LOG_FORMATS`.
        twistd: twistd's own options (the plugin options' ``parent``), or
            None when the options are parsed outside twistd (then nothing
            is changed).

    Raises:
        usage.UsageError: An unknown format, JSON asked for together with
            twistd options that choose another log (``--logger``,
            ``--syslog``), or stdout for a daemon.
    """
    global _destination
    if log_format not in LOG_FORMATS:
        raise usage.UsageError(
            f"--log-format {log_format}: unknown; use one of {', '.join(LOG_FORMATS)}"
        )
    if twistd is None:
        return
    if twistd.get("logger"):
        if log_format == "text":
            return  # the operator's own observer: what it writes is up to it
        raise usage.UsageError(
            "--log-format json chooses twistd's log observer itself; drop twistd's"
            f" --logger {twistd['logger']} or the --log-format option"
        )
    syslog = bool(twistd.get("syslog"))
    if syslog and log_format == "json":
        raise usage.UsageError(
            "--log-format json writes to stdout or --logfile, not to syslog; drop --syslog"
            " (under systemd, stdout goes to the journal)"
        )
    destination = LogDestination(
        twistd.get("logfile"),
        bool(twistd.get("nodaemon")),
        str(twistd.get("prefix") or "twisted") if syslog else None,
    )
    if not syslog and destination.logfile == "-" and not destination.nodaemon:
        raise usage.UsageError(
            f"--log-format {log_format} with --logfile=-: a daemon cannot log to stdout;"
            " add --nodaemon or name a log file"
        )
    _destination = destination
    twistd["logger"] = f"{__name__}.{log_format}_observer"


def _open(destination: LogDestination) -> IO[str]:
    """The text file the log lines go to: stdout, or a log file rotated on SIGUSR1."""
    if destination.stdout:
        # Taken now, before twistd points sys.stdout into the log itself.
        return sys.stdout
    log_file = logfile.LogFile.fromFullPath(destination.logfile or "twistd.log")
    if not signal.getsignal(signal.SIGUSR1):  # twistd's own rotation signal

        def rotate(signum: int, frame: object) -> None:
            from twisted.internet import reactor

            reactor.callFromThread(log_file.rotate)  # type: ignore[attr-defined]

        signal.signal(signal.SIGUSR1, rotate)
    return cast(IO[str], log_file)


def json_observer() -> JSONLinesObserver:
    """The log observer factory twistd calls (``--logger``): JSON lines.

    Writes where twistd would have written text (`select_log_format`
    records it); stdout when used as ``twistd --logger`` directly.
    """
    return JSONLinesObserver(_open(_destination))


def text_observer() -> EscapingObserver:
    """The log observer factory twistd calls (``--logger``): twistd's text, escaped.

    Writes twistd's own lines where twistd would have (`select_log_format`
    records it: stdout, a log file or syslog), each event through
    `escaped_event`; stdout when used as ``twistd --logger`` directly.
    """
    destination = _destination
    if destination.syslog_prefix is not None:
        from twisted.python import syslog
        from twisted.python.log import ILogObserver as ILegacyLogObserver

        legacy = syslog.SyslogObserver(destination.syslog_prefix).emit
        return EscapingObserver(LegacyLogObserverWrapper(cast(ILegacyLogObserver, legacy)))
    return EscapingObserver(textFileLogObserver(_open(destination)))
