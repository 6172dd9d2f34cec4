"""Routes: a file each (``routes/NAME.toml``) or ``[routes.NAME]`` tables of the main file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from gateway.config.base import (
    NAME,
    ConfigProblem,
    Section,
    TableSchema,
    boolean,
    choice,
    integer,
    optional_string,
    positive,
    read_toml,
    required_string,
    string,
    strings,
)
from gateway.core.addressing import AddressPattern, AddressTemplate, PatternError
from gateway.core.router import DEFAULT_ROUTE_TIMEOUT_SECONDS, Route
from gateway.core.transforms import TRANSFORMS

__all__ = ["ROUTE", "UNDELIVERABLE_LISTENERS", "load_routes", "read_route"]

DESCRIPTION: Final = string("description", "", doc="What the route is for (not used otherwise).")
FROM: Final = required_string("from", doc="The listener or upstream messages arrive at.")
TO: Final = required_string("to", doc="The listener or upstream to deliver to.")
MATCH: Final = required_string(
    "match",
    doc="The addresses taken: an exact name, or a pattern where ``*`` is one word and ``#``"
    " any run of words (``.`` and ``@`` separate words).",
)
ADDRESS: Final = optional_string(
    "address",
    doc="Destination address template: ``{address}`` is the whole source address, ``{1}``,"
    " ``{2}``... what the wildcards matched.",
    shown="the source address",
)
MATCH_SENDER: Final = optional_string(
    "match_sender", doc="Only messages from senders matching this pattern.", shown="any sender"
)
RECIPIENTS: Final = strings(
    "recipients", doc="Fixed destination addresses, instead of an address template."
)
ENVELOPE_SENDER: Final = optional_string(
    "envelope_sender", doc="The sender the destination sees.", shown="the message's sender"
)
BODY: Final = choice(
    "body",
    frozenset(TRANSFORMS),
    "unchanged",
    doc="Body transform: a body that cannot be transformed is rejected.",
)
DURABLE: Final = boolean(
    "durable",
    False,
    doc="Acknowledge once committed to the log, and forward from there (at least once).",
)
MAX_ATTEMPTS: Final = integer(
    "max_attempts",
    5,
    minimum=1,
    doc="Durable: deliveries of a message the destination rejects, then the dead letter.",
)
DEAD_LETTER: Final = string(
    "dead_letter", "msggateway.dead-letter", doc="Durable: the dead-letter stream."
)
TIMEOUT_SECONDS: Final = positive(
    "timeout_seconds",
    DEFAULT_ROUTE_TIMEOUT_SECONDS,
    doc="No outcome in time: the sender is told to retry later.",
)

ROUTE: Final = TableSchema(
    "Route",
    "routes/NAME.toml",
    (
        DESCRIPTION,
        FROM,
        MATCH,
        TO,
        ADDRESS,
        RECIPIENTS,
        MATCH_SENDER,
        ENVELOPE_SENDER,
        BODY,
        TIMEOUT_SECONDS,
        DURABLE,
        MAX_ATTEMPTS,
        DEAD_LETTER,
    ),
    doc="One route per file of the routes directory (NAME is the file's name), or a"
    " ``[routes.NAME]`` table of the main file. SIGHUP re-reads the route files; an invalid"
    " set is refused and the old one kept.",
)

UNDELIVERABLE_LISTENERS: Final = {
    "qmqp": "a QMQP listener (its clients send; nothing is delivered to them)",
    "frontend": "a TLS front-end (it relays its clients to its backend, outside any route)",
}
"""Listener protocols that routes cannot deliver to, and why."""


def read_route(
    file: str, name: str, path: str, data: dict[str, Any], problems: list[ConfigProblem]
) -> Route | None:
    """Validate one route: a whole route file (``path`` empty) or a ``[routes.NAME]`` table."""
    section = Section(file, path, data, problems, (ROUTE,))
    before = len(problems)
    section.read(DESCRIPTION)
    source = section.read(FROM)
    destination = section.read(TO)
    match = section.read(MATCH)
    address = section.read(ADDRESS)
    match_sender = section.read(MATCH_SENDER)
    recipients = section.read(RECIPIENTS)
    envelope_sender = section.read(ENVELOPE_SENDER)
    body = section.read(BODY)
    durable = section.read(DURABLE)
    max_attempts = section.read(MAX_ATTEMPTS)
    dead_letter = section.read(DEAD_LETTER)
    timeout = section.read(TIMEOUT_SECONDS)
    section.done()
    pattern: AddressPattern | None = None
    target: AddressTemplate | None = None
    sender_pattern: AddressPattern | None = None
    if match:
        try:
            pattern = AddressPattern(match)
        except PatternError as exc:
            section.problem(MATCH, str(exc))
    if match_sender is not None:
        try:
            sender_pattern = AddressPattern(match_sender)
        except PatternError as exc:
            section.problem(MATCH_SENDER, str(exc))
    if recipients and address is not None:
        section.problem(
            RECIPIENTS, "give either address (a template) or recipients (fixed), not both"
        )
    for recipient in recipients:
        if not recipient or recipient != recipient.strip():
            section.problem(RECIPIENTS, f"{recipient!r} is not an address")
    if address is not None:
        try:
            target = AddressTemplate(address)
            if pattern is not None:
                target.check_against(pattern)
        except PatternError as exc:
            section.problem(ADDRESS, str(exc))
    if len(problems) > before or pattern is None or source is None or destination is None:
        return None
    return Route(
        name=name,
        source=source,
        pattern=pattern,
        destination=destination,
        target=target,
        durable=durable,
        timeout_seconds=timeout,
        match_sender=sender_pattern,
        recipients=recipients,
        envelope_sender=envelope_sender,
        body=body,
        max_attempts=max_attempts,
        dead_letter=dead_letter,
    )


def load_routes(directory: Path, problems: list[ConfigProblem]) -> tuple[Route, ...]:
    """Read every ``*.toml`` route file of a directory, in name order."""
    if not directory.is_dir():
        problems.append(ConfigProblem(str(directory), "-", "routes directory not found"))
        return ()
    routes: list[Route] = []
    for path in sorted(directory.glob("*.toml")):
        if not NAME.match(path.stem):
            problems.append(
                ConfigProblem(str(path), "-", "a route file name must be letters, digits, _.-")
            )
            continue
        data = read_toml(path, problems)
        if data is not None:
            route = read_route(str(path), path.stem, "", data, problems)
            if route is not None:
                routes.append(route)
    return tuple(routes)
