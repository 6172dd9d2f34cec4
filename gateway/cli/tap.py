"""``msggateway tap``: watch the messages on a listener or a route of a running gateway.

It attaches to the admin endpoint's ``/tap`` (`gateway.admin.tap`) with the
admin token, never taken from the command line: from the environment
variable ``--token-env`` names when it is set, else from the gateway's
configuration (``--config``, by default the embedded default as run from
this directory): its secrets file's ``admin_token``, or without one the
token the gateway made in its data dir (`gateway.config.admintoken`). The
admin endpoint's URL is ``--admin``, or the configuration's ``[admin]``
endpoint. It prints one line per message as the gateway routes it::

    2025-05-01T12:00:00.123Z mail:ops@example.com -> to-hub -> hub:ops.mail
        id=1f2e-7 from=alice 1234 B accepted

(on one line): when, where it came in, each route it took with the
destination and address it went to, its id, sender and body size, and its
outcome (with each refusing route's code and reason). ``--json`` prints
the gateway's JSON lines as they are instead. What the gateway left out
(sampled out, or dropped because this reader was behind) is written to
stderr whenever it changes. Ctrl-C ends the tap cleanly. Exit status: 0
when ended by Ctrl-C or after ``--count`` messages, 1 when the gateway
refused or ended the tap, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final, TextIO

from gateway.cli.arguments import Commands, add_receiver_arguments, add_timeout_argument, positive
from gateway.cli.errors import CommandError, UsageError
from gateway.cli.output import Output, progress_bar

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

__all__ = ["Gateway", "add_commands", "admin_token", "admin_url", "describe", "follow", "tap_url"]

DEFAULT_TOKEN_ENV: Final = "MSGGATEWAY_ADMIN_TOKEN"
MAX_LINE_BYTES: Final = 1024 * 1024
"""A record longer than this is not one the gateway writes: the stream is broken."""


def add_commands(commands: Commands) -> None:
    """Add ``tap``."""
    tap = commands.add_parser(
        "tap",
        help="watch the messages on a listener or route of a running gateway",
        description="Attach to a running gateway's admin endpoint and print each message"
        " that arrives at a listener, or that a route takes, as it is routed: where it came"
        " from, the routes it took and where they delivered it, its id, sender, size and"
        " outcome. Needs the admin token: from the environment variable --token-env names"
        " if set, else from the gateway's configuration (its secrets file's admin_token, or"
        " the token the gateway made in its data dir, which the user running this must be"
        " allowed to read). Ctrl-C stops.",
    )
    tap.add_argument(
        "--config",
        metavar="PATH",
        help="the gateway's main config file, for its admin endpoint and admin token"
        " (default: the embedded default, its data dir var/ in this directory)",
    )
    tap.add_argument(
        "--admin",
        metavar="URL",
        help="the gateway's admin endpoint, e.g. http://127.0.0.1:8790 (default: the"
        " configuration's [admin] endpoint)",
    )
    which = tap.add_mutually_exclusive_group(required=True)
    which.add_argument("--listener", metavar="NAME", help="watch what arrives at this listener")
    which.add_argument("--route", metavar="NAME", help="watch what this route takes")
    tap.add_argument(
        "--match",
        metavar="PATTERN",
        help="only messages whose address (or a recipient) matches, as a route's pattern"
        " (weather.*, #@example.com)",
    )
    tap.add_argument(
        "--sample",
        type=_rate,
        default=1.0,
        metavar="RATE",
        help="show this share of the matching messages, e.g. 0.01 (default: 1, all)",
    )
    tap.add_argument(
        "--max",
        type=positive(int),
        default=None,
        metavar="RECORDS",
        help="records the gateway keeps for us while we are behind, past which it drops"
        " them and says how many (default: the gateway's, 1000)",
    )
    tap.add_argument(
        "--per-second",
        type=positive(int),
        default=None,
        metavar="RECORDS",
        help="take at most this many records a second, the rest counted as sampled out"
        " (what the status page asks for; default: no cap)",
    )
    tap.add_argument(
        "--token-env",
        default=DEFAULT_TOKEN_ENV,
        metavar="VAR",
        help="environment variable holding the admin token, used when set (default:"
        f" {DEFAULT_TOKEN_ENV})",
    )
    add_timeout_argument(tap, what="seconds to wait for the gateway to answer")
    add_receiver_arguments(tap)
    tap.set_defaults(run=_run)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0 and at most 1")
    return value


def tap_url(admin: str, args: argparse.Namespace) -> urllib.parse.SplitResult:
    """The ``/tap`` URL for the arguments, under the admin endpoint's URL.

    Raises:
        UsageError: ``admin`` is not an http or https URL.
    """
    base = urllib.parse.urlsplit(admin)
    if base.scheme not in ("http", "https") or not base.hostname:
        raise UsageError(f"--admin {admin!r} is not an http:// or https:// URL")
    query: dict[str, str] = {}
    if args.listener is not None:
        query["listener"] = args.listener
    else:
        query["route"] = args.route
    if args.match is not None:
        query["match"] = args.match
    if args.sample != 1.0:
        query["sample"] = repr(args.sample)
    if args.max is not None:
        query["max"] = str(args.max)
    if args.per_second is not None:
        query["per_second"] = str(args.per_second)
    path = base.path.rstrip("/") + "/tap"
    return base._replace(path=path, query=urllib.parse.urlencode(query), fragment="")


class Gateway:
    """The configuration ``--config`` names, read once and only if needed."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._config: GatewayConfig | None = None

    @property
    def config(self) -> GatewayConfig:
        """The configuration.

        Raises:
            CommandError: It has problems (or a file cannot be read).
        """
        if self._config is None:
            from gateway.config import ConfigError, load_config, load_default_config

            try:
                self._config = load_config(Path(self.path)) if self.path else load_default_config()
            except ConfigError as exc:
                problems = "\n  ".join(map(str, exc.problems))
                raise CommandError(
                    f"cannot read the gateway's configuration:\n  {problems}\n(--admin and the"
                    " variable --token-env names need none)"
                ) from None
        return self._config


def admin_url(config: GatewayConfig) -> str:
    """The URL a client on this host reaches the configuration's admin endpoint at.

    A wildcard interface (none, ``0.0.0.0``, ``::``) is reached on loopback;
    ``ssl:`` and ``mtls:`` endpoints are https.

    Raises:
        UsageError: The admin endpoint is off, or not a TCP port.
    """
    from gateway.config.endpoints import endpoint_port
    from gateway.tls import split_endpoint_string

    where = config.source
    if config.admin.endpoint is None:
        raise UsageError(f"the admin endpoint is off in {where} ([admin] enabled = false)")
    fields = split_endpoint_string(config.admin.endpoint)
    port = endpoint_port(config.admin.endpoint)
    if not port:
        raise UsageError(
            f"give --admin URL: {where}'s admin endpoint {config.admin.endpoint!r} is no TCP port"
        )
    interface = next(
        (field.partition("=")[2] for field in fields if field.startswith("interface=")), ""
    ).replace("\\", "")
    if interface in ("", "0.0.0.0"):
        interface = "::1" if fields[0] == "tcp6" else "127.0.0.1"
    elif interface == "::":
        interface = "::1"
    try:
        host = f"[{interface}]" if ipaddress.ip_address(interface).version == 6 else interface
    except ValueError:
        host = interface
    scheme = "https" if fields[0] in ("ssl", "mtls") else "http"
    return f"{scheme}://{host}:{port}"


def admin_token(variable: str, gateway: Gateway) -> tuple[str, str]:
    """The admin token, and where it came from (for the hint when it is refused).

    Raises:
        CommandError: The configuration or the token file cannot be read.
        UsageError: There is no token anywhere.
    """
    from gateway.config.admintoken import read_admin_token, token_path

    value = os.environ.get(variable)
    if value is not None:
        return value, f"the environment variable {variable}"
    config = gateway.config
    if config.secrets.admin_token is not None:
        return config.secrets.admin_token.decode("utf-8"), f"admin_token in {config.secrets_path}"
    path = token_path(config.data_dir)
    try:
        token = read_admin_token(config.data_dir)
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CommandError(
            f"cannot read the admin token in {path}: {reason} (run this as the gateway's user,"
            f" or set {variable})"
        ) from None
    if token is None:
        raise UsageError(
            f"no admin token: {variable} is not set, {config.source} has no admin_token, and"
            f" {path} does not exist (the gateway makes it at its first start; --config names"
            " the gateway's main file)"
        )
    return token, str(path)


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    gateway = Gateway(args.config)
    token, source = admin_token(args.token_env, gateway)
    url = tap_url(args.admin or admin_url(gateway.config), args)
    response, connection = _open(url, token, args.timeout, source)
    bar = progress_bar(args, err, total=args.count or None, desc="tapped")
    output = Output(out, json_lines=args.json, bar=bar)
    shown = 0

    def count(_: Mapping[str, object]) -> None:
        nonlocal shown
        shown += 1
        bar.update(1)

    try:
        return follow(
            _lines(response),
            output,
            err,
            json_lines=args.json,
            count=args.count,
            on_message=count,
        )
    except KeyboardInterrupt:
        err.write(f"msggateway: tap ended, {shown} message(s) shown\n")
        return 0
    finally:
        bar.close()
        connection.close()


def _open(
    url: urllib.parse.SplitResult, token: str, timeout: float | None, source: str
) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
    """Ask for the tap with ``token`` (from ``source``); return the response once it is 200.

    Raises:
        CommandError: The gateway could not be reached, or refused.
    """
    host = url.hostname or ""
    connection: http.client.HTTPConnection
    if url.scheme == "https":
        connection = http.client.HTTPSConnection(
            host, url.port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(host, url.port, timeout=timeout)
    target = f"{url.path}?{url.query}"
    try:
        connection.request(
            "GET",
            target,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/x-ndjson"},
        )
        response = connection.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        where = urllib.parse.urlunsplit(url._replace(query=""))
        raise CommandError(f"cannot reach {where}: {exc}") from None
    if response.status != http.HTTPStatus.OK:
        reason = _refusal(response, source)
        connection.close()
        raise CommandError(f"the gateway refused the tap ({response.status}): {reason}")
    # From now on, a quiet route is not a time-out: wait for lines for ever.
    if connection.sock is not None:
        connection.sock.settimeout(None)
    return response, connection


def _refusal(response: http.client.HTTPResponse, source: str) -> str:
    """The error a refusing answer carries, with a hint for the usual ones."""
    body = response.read(MAX_LINE_BYTES)
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and "error" in answer:
        reason = str(answer["error"])
        if answer.get("known"):
            reason += f" (known: {', '.join(map(str, answer['known']))})"
    else:
        reason = body.decode("utf-8", "replace").strip() or response.reason
    if response.status == http.HTTPStatus.UNAUTHORIZED:
        reason += (
            f" (the token came from {source}; the gateway's is admin_token in its secrets file,"
            " or without one the admin-token file in its data dir)"
        )
    return reason


def _lines(response: http.client.HTTPResponse) -> Iterable[bytes]:
    """The response's lines as they come (chunked transfer undone by http.client)."""
    while True:
        try:
            line = response.readline(MAX_LINE_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise CommandError(f"the tap broke off: {exc}") from None
        if not line:
            return
        if not line.endswith(b"\n"):
            if len(line) > MAX_LINE_BYTES:
                raise CommandError("the gateway sent a line longer than any record")
            return  # the connection ended mid-line
        yield line


def follow(
    lines: Iterable[bytes],
    output: Output,
    err: TextIO,
    *,
    json_lines: bool = False,
    count: int = 0,
    on_message: Callable[[Mapping[str, object]], None] | None = None,
) -> int:
    """Print a tap's lines as they come; return the exit status.

    Args:
        lines: The gateway's JSON lines.
        output: Where messages (and, with ``--json``, every line) go.
        err: Where the text mode says what is tapped and what was left out.
        json_lines: Every line goes to ``output`` as it is (``--json``).
        count: Stop after this many messages; 0: never.
        on_message: Told each message record.

    Raises:
        CommandError: The gateway ended the tap, or the stream broke off.
    """
    shown = 0
    for raw in lines:
        try:
            record = json.loads(raw)
        except ValueError:
            raise CommandError(f"the gateway sent something that is not JSON: {raw!r}") from None
        if not isinstance(record, dict):
            continue
        if "id" in record:
            output.emit(describe(record), record)
            shown += 1
            if on_message is not None:
                on_message(record)
            if count and shown >= count:
                return 0
            continue
        if json_lines:
            output.emit("", record)
        elif "tap" in record:
            err.write(f"msggateway: tapping {_what(record['tap'])}; Ctrl-C stops\n")
        elif "seen" in record and "end" not in record:
            behind = " (dropped: we read too slowly)" if record.get("dropped") else ""
            err.write(f"msggateway: {_counts(record)}{behind}\n")
        if "end" in record:
            raise CommandError(f"the gateway ended the tap: {record['end']} ({_counts(record)})")
        err.flush()
    raise CommandError("the gateway closed the tap")


def _what(tap: object) -> str:
    if not isinstance(tap, dict):
        return "?"
    what = f"listener {tap['listener']}" if tap.get("listener") else f"route {tap.get('route')}"
    if tap.get("match"):
        what += f", addresses matching {tap['match']}"
    if tap.get("sample", 1) != 1:
        what += f", {float(tap['sample']):.4g} of them"
    return what


def _counts(record: Mapping[str, object]) -> str:
    return (
        f"{record.get('seen', 0)} seen, {record.get('shown', 0)} shown,"
        f" {record.get('sampled_out', 0)} sampled out, {record.get('dropped', 0)} dropped"
    )


def describe(record: Mapping[str, object]) -> str:
    """One message record as a line of text.

    ``TIME SOURCE:ADDRESS -> ROUTE -> DESTINATION:ADDRESS[, ...] id=ID
    from=SENDER SIZE B OUTCOME[ (ROUTE: STATUS CODE REASON; ...)]``, where
    a message with recipients shows the first and how many more.
    """
    address = str(record.get("address") or "")
    recipients = record.get("recipients")
    if isinstance(recipients, list) and recipients:
        total = record.get("recipients_count", len(recipients))
        more = total - 1 if isinstance(total, int) else 0
        address = f"{recipients[0]} +{more}" if more else str(recipients[0])
    routes = record.get("routes")
    taken = (
        [route for route in routes if isinstance(route, dict)] if isinstance(routes, list) else []
    )
    went = ", ".join(
        f"{route.get('route')} -> {route.get('destination', '?')}"
        + (f":{route['address']}" if "address" in route else "")
        for route in taken
    )
    refusals = "; ".join(
        " ".join(
            str(part)
            for part in (
                f"{route.get('route')}:",
                route.get("status"),
                route.get("code"),
                route.get("reason"),
            )
            if part
        )
        for route in taken
        if route.get("status") != "accepted"
    )
    line = (
        f"{_time(record.get('time'))} {record.get('listener')}:{address}"
        f" -> {went or '(no route)'} id={record.get('id')} from={record.get('sender') or '-'}"
        f" {record.get('size')} B {record.get('outcome')}"
    )
    return f"{line} ({refusals})" if refusals else line


def _time(value: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    seconds = time.gmtime(value)
    return time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{int(value % 1 * 1000):03d}Z"
