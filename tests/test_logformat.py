"""Log lines (`gateway.logformat`): JSON, escaped text, and twistd's ``--log-format``."""

from __future__ import annotations

import io
import json
import signal
import syslog
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.logger import ILogObserver, Logger, LogLevel, LogPublisher, textFileLogObserver
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.python.log import textFromEventDict
from twisted.python.syslog import SyslogObserver
from twisted.scripts._twistd_unix import ServerOptions, UnixAppLogger
from zope.interface.verify import verifyObject

from gateway import logformat
from gateway.logformat import (
    FIELDS,
    EscapingObserver,
    JSONLinesObserver,
    LogDestination,
    escaped_event,
    event_as_json,
    json_observer,
    select_log_format,
    text_observer,
)

MINIMAL_CONFIG = '[listeners.hub]\nprotocol = "ssmp"\nendpoint = "tcp:0:interface=127.0.0.1"\n'
HOSTILE = "\x1b[2J\x1b[31mroot\r\nFORGED"
"""What a peer might get quoted in a log line: clear the screen, turn red, forge a line."""
HOSTILE_ESCAPED = "\\x1b[2J\\x1b[31mroot\\r\\nFORGED"


@pytest.fixture(autouse=True)
def _destination() -> Iterator[None]:
    """Each test starts from, and leaves, the module's default destination."""
    saved = logformat._destination
    yield
    logformat._destination = saved


def _logged(emit: Any) -> list[dict[str, Any]]:
    """The JSON objects one `Logger` call writes through a `JSONLinesObserver`."""
    out = io.StringIO()
    publisher = LogPublisher(JSONLinesObserver(out))
    emit(Logger(namespace="gateway.test", observer=publisher))
    text = out.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_an_event_is_one_object_with_its_fields_on_top() -> None:
    """One object: time (UTC, ISO 8601), level, namespace, message, known fields as keys."""
    [record] = _logged(
        lambda log: log.warn(
            "{listener}: bad input from {peer}: {reason}",
            listener="hub",
            peer="127.0.0.1:5000",
            reason="line too long",
            identity="alice",
            route="mail",
        )
    )
    assert record["level"] == "warn"
    assert record["namespace"] == "gateway.test"
    assert record["message"] == "hub: bad input from 127.0.0.1:5000: line too long"
    assert record["time"].endswith("Z") and "T" in record["time"]
    assert {key: record[key] for key in ("listener", "peer", "reason", "identity", "route")} == {
        "listener": "hub",
        "peer": "127.0.0.1:5000",
        "reason": "line too long",
        "identity": "alice",
        "route": "mail",
    }


def test_the_time_is_utc_with_milliseconds() -> None:
    """A known timestamp comes out in UTC, to the millisecond."""
    event = {"log_time": 1_700_000_000.25, "log_level": LogLevel.info, "log_format": "x"}
    assert json.loads(event_as_json(event))["time"] == "2023-11-14T22:13:20.250Z"


def test_unknown_keys_stay_out_and_known_ones_are_made_plain() -> None:
    """Only `FIELDS` become keys; bytes, addresses, objects and NaN become JSON values."""
    [record] = _logged(
        lambda log: log.info(
            "{upstream} {stream}",
            upstream=b"central",
            stream="orders",
            peer=IPv4Address("TCP", "10.0.0.1", 4242),
            reason=ValueError("nope"),
            seconds=float("nan"),
            listening={"hub": "127.0.0.1:1"},
            internal=object(),
        )
    )
    assert record["upstream"] == "central"
    assert record["peer"] == "10.0.0.1:4242"
    assert record["reason"] == "nope"
    assert record["seconds"] == "nan"
    assert record["listening"] == {"hub": "127.0.0.1:1"}
    assert "internal" not in record
    assert not any(key.startswith("log_") for key in record)


def test_a_multi_line_message_stays_on_one_line() -> None:
    """The format's own line break is kept (JSON escapes it); a field's becomes backslash-n."""
    [record] = _logged(lambda log: log.error("refused:\n{problems}", problems="a\nb"))
    assert record["message"] == "refused:\na\\nb"
    assert record["problems"] == "a\\nb"


# --- peer input is escaped ---------------------------------------------------------------


def _text_lines(emit: Any) -> str:
    """What one `Logger` call writes through twistd's text observer, escaped as twistd runs it."""
    out = io.StringIO()
    publisher = LogPublisher(EscapingObserver(textFileLogObserver(out)))
    emit(Logger(namespace="gateway.test", observer=publisher))
    return out.getvalue()


def _no_controls(text: str) -> bool:
    """Whether ``text`` holds no control character but LF (and the tab that continues a line)."""
    return not any(
        (ord(char) < 0x20 and char not in "\n\t") or 0x7F <= ord(char) <= 0x9F for char in text
    )


def _warn_hostile(log: Logger) -> None:
    """The gateway's warning about a bad verb, the verb a hostile peer's."""
    log.warn(
        "{listener}: bad input from {peer}: {reason}",
        listener="hub",
        peer="192.0.2.1:40000",
        reason=f"verb {HOSTILE!r} is not upper-case letters; raw: {HOSTILE}",
    )


def test_text_escapes_control_characters_in_fields() -> None:
    """A field holding ESC, CR and LF is written as one text line, its escapes visible."""
    text = _text_lines(_warn_hostile)
    assert text.endswith("\n") and text.count("\n") == 1
    assert _no_controls(text)
    assert f"raw: {HOSTILE_ESCAPED}\n" in text
    assert "bad input from 192.0.2.1:40000" in text


def test_json_escapes_control_characters_in_fields_and_message() -> None:
    """The JSON line's message and fields, once decoded, hold visible escapes, not controls."""
    out = io.StringIO()
    _warn_hostile(Logger(namespace="gateway.test", observer=JSONLinesObserver(out)))
    assert out.getvalue().count("\n") == 1
    record = json.loads(out.getvalue())
    assert _no_controls(record["message"]) and "\n" not in record["message"]
    assert record["message"].endswith(f"raw: {HOSTILE_ESCAPED}")
    assert record["reason"].endswith(f"raw: {HOSTILE_ESCAPED}")


@pytest.mark.parametrize(
    ("char", "escape"),
    [
        ("\x00", "\\x00"),
        ("\x07", "\\x07"),
        ("\t", "\\t"),
        ("\x7f", "\\x7f"),
        ("\x9b", "\\x9b"),  # C1 CSI
        ("\u2028", "\\u2028"),
        ("\u202e", "\\u202e"),  # right-to-left override
    ],
)
def test_every_kind_of_control_is_escaped(char: str, escape: str) -> None:
    """NUL, BEL, TAB, DEL, C1, the line separator and bidi overrides come out escaped."""
    text = _text_lines(lambda log: log.info("got {what}", what=f"a{char}b"))
    assert text.endswith(f"got a{escape}b\n")
    [record] = _logged(lambda log: log.info("got {what}", what=f"a{char}b"))
    assert record["message"] == f"got a{escape}b"


def test_fields_reached_into_are_escaped() -> None:
    """Attributes, items, calls, ``!r`` and bytes fields render escaped as well."""
    peer = IPv4Address("TCP", "10.0.0.1\r\n", 4242)
    text = _text_lines(
        lambda log: log.info(
            "{peer.host} {items[0]} {say()} {error!r} {data}",
            peer=peer,
            items=["\x1b[1m"],
            say=lambda: "\r",
            error=ValueError("\n"),
            data=b"\x1b",
        )
    )
    assert text.endswith("10.0.0.1\\r\\n \\x1b[1m \\r ValueError('\\n') b'\\x1b'\n")
    assert text.count("\n") == 1


def test_the_format_strings_own_line_breaks_are_kept_in_text() -> None:
    """A multi-line format string is continued with a tab, as twistd writes it."""
    text = _text_lines(lambda log: log.error("refused:\n{problems}", problems="a\nb"))
    assert text.endswith("refused:\n\ta\\nb\n")


def test_a_traceback_keeps_its_lines_in_both_formats() -> None:
    """log.failure's traceback stays readable; the fields and the message are escaped."""

    def emit(log: Logger) -> None:
        try:
            raise RuntimeError("boom\x1b[2J")
        except RuntimeError:
            log.failure("forwarding {route} failed", route=HOSTILE)

    text = _text_lines(emit)
    first, *rest = text.splitlines()
    assert first.endswith(f"forwarding {HOSTILE_ESCAPED} failed")
    assert rest[0] == "\tTraceback (most recent call last):"
    assert all(line.startswith("\t") for line in rest)
    assert rest[-1].endswith("RuntimeError: boom\\x1b[2J")
    assert _no_controls(text)
    [record] = _logged(emit)
    assert record["message"] == f"forwarding {HOSTILE_ESCAPED} failed"
    assert record["traceback"].startswith("Traceback (most recent call last):\n")
    assert record["traceback"].endswith("RuntimeError: boom\\x1b[2J")


def test_a_legacy_error_keeps_its_traceback_lines() -> None:
    """twisted.python.log.err (Twisted's own code): why escaped, traceback on its own lines."""
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failure = Failure()
    legacy: dict[str, Any] = {
        "message": (),
        "isError": 1,
        "failure": failure,
        "why": f"lost {HOSTILE}",
        "system": "-",
    }
    # As twisted.python.log hands it to twisted.logger's observers:
    event = {
        **legacy,
        "log_text": textFromEventDict(legacy),
        "log_format": "{log_text}",
        "log_level": LogLevel.critical,
        "log_namespace": "log_legacy",
        "log_system": "-",
        "log_time": 0.0,
    }
    out = io.StringIO()
    EscapingObserver(textFileLogObserver(out))(event)
    first, *rest = out.getvalue().splitlines()
    assert first.endswith(f"lost {HOSTILE_ESCAPED}")
    assert rest[0] == "\tTraceback (most recent call last):"
    assert rest[-1].endswith("RuntimeError: boom")


def test_escaped_event_keeps_time_level_namespace_and_escapes_the_system() -> None:
    """`escaped_event` carries what twistd's line shows; the system is escaped too."""
    event = {
        "log_format": "x",
        "log_time": 1.0,
        "log_level": LogLevel.warn,
        "log_namespace": "gateway.test",
        "log_system": "SSMPServerProtocol,0,\x1b",
    }
    assert escaped_event(event) == {
        "log_format": "{log_text}",
        "log_text": "x",
        "log_time": 1.0,
        "log_level": LogLevel.warn,
        "log_namespace": "gateway.test",
        "log_system": "SSMPServerProtocol,0,\\x1b",
    }


@pytest.fixture
def tagged() -> Iterator[str]:
    """Lines tagged with a worker's node id while the test runs."""
    logformat.tag_lines("gw-x-1")
    try:
        yield "gw-x-1"
    finally:
        logformat.tag_lines(None)


def test_a_workers_json_lines_carry_its_node(tagged: str) -> None:
    """Every JSON line of a worker has its node id, whatever the event."""
    record = json.loads(event_as_json({"log_format": "x", "log_namespace": "n"}))
    assert record["node"] == tagged


def test_a_workers_text_lines_start_their_system_with_its_node(tagged: str) -> None:
    """Text: ``[NODE,SYSTEM]``, or ``[NODE,NAMESPACE#LEVEL]`` where twistd would show that."""
    with_system = {"log_format": "x", "log_system": "SSMPServerProtocol,3,127.0.0.1"}
    assert escaped_event(with_system)["log_system"] == f"{tagged},SSMPServerProtocol,3,127.0.0.1"
    without = {"log_format": "x", "log_namespace": "gateway.service", "log_level": LogLevel.info}
    assert escaped_event(without)["log_system"] == f"{tagged},gateway.service#info"


def test_lines_carry_no_node_unless_tagged() -> None:
    """A single gateway's lines are as they always were."""
    assert "node" not in json.loads(event_as_json({"log_format": "x"}))
    assert "log_system" not in escaped_event({"log_format": "x"})


def test_a_failure_carries_its_traceback() -> None:
    """log.failure puts the traceback under "traceback", the message stays short."""

    def emit(log: Logger) -> None:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.failure("forwarding {route} failed", route="mail")

    [record] = _logged(emit)
    assert record["level"] == "critical"
    assert record["message"] == "forwarding mail failed"
    assert record["route"] == "mail"
    assert "Traceback" in record["traceback"] and "RuntimeError: boom" in record["traceback"]


def test_a_message_that_cannot_be_formatted_is_still_a_line() -> None:
    """A format string naming a missing key gives Twisted's notice, not an exception."""
    [record] = _logged(lambda log: log.info("{missing} here"))
    assert "Unable to format event" in record["message"]


def test_legacy_log_messages_are_lines_too() -> None:
    """twisted.python.log.msg (Twisted's own ports, factories) comes out as text."""
    out = io.StringIO()
    observer = JSONLinesObserver(out)
    publisher = LogPublisher(observer)
    publisher(
        {
            "log_format": "{log_text}",
            "log_text": "SSMPServerFactory starting on 4242",
            "log_namespace": "log_legacy",
            "log_time": 0.0,
        }
    )
    record = json.loads(out.getvalue())
    assert record["message"] == "SSMPServerFactory starting on 4242"
    assert record["level"] == "info"


def test_the_observer_provides_the_interface() -> None:
    """What twistd gets from the factory is a `ILogObserver`."""
    assert verifyObject(ILogObserver, JSONLinesObserver(io.StringIO()))


def test_fields_do_not_clash_with_the_record_keys() -> None:
    """No field can overwrite time, level, namespace, message or traceback."""
    assert not FIELDS & {"time", "level", "namespace", "message", "traceback"}


# --- the twistd option --------------------------------------------------------------------


def _parse(tmp_path: Path, before: list[str], after: list[str]) -> ServerOptions:
    """Parse a twistd command line as twistd does, plugin options included."""
    config_path = tmp_path / "gateway.toml"
    config_path.write_text(MINIMAL_CONFIG)
    twistd_options = ServerOptions()
    twistd_options.parseOptions([*before, "msggateway", "--config", str(config_path), *after])
    return twistd_options


def test_text_is_the_default_and_names_the_escaping_text_observer(tmp_path: Path) -> None:
    """Without --log-format twistd writes its text through `text_observer` (its --logger)."""
    options = _parse(tmp_path, ["--nodaemon"], [])
    assert options.subOptions["log-format"] == "text"
    assert options["logger"] is text_observer
    assert UnixAppLogger(options)._observerFactory is text_observer
    assert logformat._destination == LogDestination(None, nodaemon=True)


def test_text_leaves_an_operators_own_logger_alone(tmp_path: Path) -> None:
    """With text, twistd's --logger stays the operator's choice."""
    options = _parse(tmp_path, ["-n", "--logger=twisted.logger.textFileLogObserver"], [])
    assert options["logger"] is textFileLogObserver
    assert logformat._destination == LogDestination()


def test_text_goes_to_the_log_file_escaped(tmp_path: Path) -> None:
    """With --logfile, twistd's text lines go to that file, peer input escaped."""
    path = tmp_path / "gateway.log"
    _parse(tmp_path, ["--nodaemon", f"--logfile={path}"], [])
    saved = signal.getsignal(signal.SIGUSR1)
    try:
        observer = text_observer()
        assert signal.getsignal(signal.SIGUSR1) not in (saved, signal.SIG_DFL)  # rotation
        observer({"log_format": "bad {verb}", "verb": HOSTILE, "log_time": 0.0})
    finally:
        signal.signal(signal.SIGUSR1, saved)
    [line] = path.read_text().splitlines()
    assert line.endswith(f"bad {HOSTILE_ESCAPED}")


def test_text_to_syslog_is_escaped_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --syslog, each syslog message is twistd's text with peer input escaped."""
    sent: list[tuple[int, str]] = []
    monkeypatch.setattr(SyslogObserver, "openlog", lambda *args: None)
    record = staticmethod(lambda priority, text: sent.append((priority, text)))
    monkeypatch.setattr(SyslogObserver, "syslog", record)
    _parse(tmp_path, ["-n", "--syslog", "--prefix=gw"], [])
    assert logformat._destination.syslog_prefix == "gw"
    observer = text_observer()
    observer(
        {"log_format": "bad {verb}", "verb": HOSTILE, "log_level": LogLevel.warn, "log_time": 0.0}
    )
    assert sent == [(syslog.LOG_INFO, f"[-] bad {HOSTILE_ESCAPED}")]


def test_a_daemon_cannot_write_text_to_stdout(tmp_path: Path) -> None:
    """--logfile=- without --nodaemon is refused at once, as twistd would refuse it at start."""
    with pytest.raises(usage.UsageError, match="a daemon cannot log to stdout"):
        _parse(tmp_path, ["--logfile=-"], [])


def test_json_names_the_observer_factory_as_twistds_logger(tmp_path: Path) -> None:
    """--log-format json becomes twistd's --logger, which its app logger calls."""
    options = _parse(tmp_path, ["--nodaemon", "--logfile=-"], ["--log-format", "json"])
    assert options["logger"] is json_observer
    assert UnixAppLogger(options)._observerFactory is json_observer
    assert logformat._destination == LogDestination("-", nodaemon=True)


def test_json_goes_to_stdout_in_the_foreground(tmp_path: Path) -> None:
    """In the foreground without --logfile (twistd -n), JSON goes to stdout."""
    _parse(tmp_path, ["-n"], ["--log-format", "json"])
    assert logformat._destination.stdout


def test_json_goes_to_the_log_file_when_one_is_named(tmp_path: Path) -> None:
    """With --logfile the JSON lines go to that file, one per event."""
    path = tmp_path / "gateway.log"
    _parse(tmp_path, ["--nodaemon", f"--logfile={path}"], ["--log-format", "json"])
    saved = signal.getsignal(signal.SIGUSR1)
    try:
        observer = json_observer()
        assert signal.getsignal(signal.SIGUSR1) not in (saved, signal.SIG_DFL)  # rotation
        observer({"log_format": "one {listener}", "listener": "hub", "log_time": 0.0})
        observer({"log_format": "two", "log_time": 0.0})
    finally:
        signal.signal(signal.SIGUSR1, saved)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["one hub", "two"]


@pytest.mark.parametrize(
    ("before", "complaint"),
    [
        (["--logfile=-"], "a daemon cannot log to stdout"),
        (["-n", "--syslog"], "drop --syslog"),
        (["-n", "--logger=twisted.logger.textFileLogObserver"], "drop twistd's --logger"),
    ],
)
def test_json_refuses_other_log_choices(tmp_path: Path, before: list[str], complaint: str) -> None:
    """JSON with a daemon on stdout, syslog or another --logger is a usage error saying why."""
    with pytest.raises(usage.UsageError, match=complaint):
        _parse(tmp_path, before, ["--log-format", "json"])


def test_an_unknown_format_is_a_usage_error(tmp_path: Path) -> None:
    """--log-format takes text or json only."""
    with pytest.raises(usage.UsageError, match="use one of text, json"):
        _parse(tmp_path, ["-n"], ["--log-format", "xml"])


def test_outside_twistd_the_option_changes_nothing() -> None:
    """Parsed on their own (no twistd parent) the options only record the choice."""
    select_log_format("json", None)
    assert logformat._destination == LogDestination()
