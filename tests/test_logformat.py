"""JSON log lines (`gateway.logformat`) and ``--log-format`` on twistd's command line."""

from __future__ import annotations

import io
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.logger import ILogObserver, Logger, LogLevel, LogPublisher
from twisted.python import usage
from twisted.scripts._twistd_unix import ServerOptions, UnixAppLogger
from zope.interface.verify import verifyObject

from gateway import logformat
from gateway.logformat import (
    FIELDS,
    JSONLinesObserver,
    LogDestination,
    event_as_json,
    json_observer,
    select_log_format,
)

MINIMAL_CONFIG = '[listeners.hub]\nprotocol = "ssmp"\nendpoint = "tcp:0:interface=127.0.0.1"\n'


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
    """Line breaks in the message are escaped: one event, one line."""
    [record] = _logged(lambda log: log.error("refused:\n{problems}", problems="a\nb"))
    assert record["message"] == "refused:\na\nb"
    assert record["problems"] == "a\nb"


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


def test_text_is_the_default_and_leaves_twistd_alone(tmp_path: Path) -> None:
    """Without --log-format twistd keeps its own observer (no --logger)."""
    options = _parse(tmp_path, ["--nodaemon"], [])
    assert options.subOptions["log-format"] == "text"
    assert options["logger"] is None


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
