"""Routes: a file each (``routes/NAME.toml``) or ``[routes.NAME]`` tables of the main file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import attrs

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
from gateway.core.internal import DEAD_LETTER_STREAM
from gateway.core.router import DEFAULT_ROUTE_TIMEOUT_SECONDS, Route
from gateway.core.transforms import TRANSFORMS

__all__ = ["ROUTE", "UNDELIVERABLE_LISTENERS", "WrittenRoute", "load_routes", "read_route"]

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
    "dead_letter", DEAD_LETTER_STREAM, doc="Durable: the dead-letter stream."
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


@attrs.frozen
class WrittenRoute:
    """A route as read from its file or table: where it is, its two ends, and whether it is valid.

    The ends are kept even when the route has problems of its own, so that
    the checks that need the other tables (does ``from`` name a listener?)
    report theirs too, and one run reports every problem.

    Attributes:
        name: The route's name.
        file: The file it is written in.
        path: Its key path in that file (empty for a route file of its own).
        source: ``from`` as written, if it is a string that is not empty.
        destination: ``to`` as written, likewise.
        route: The route, or None when it has a problem.
    """

    name: str
    file: str
    path: str
    source: str | None
    destination: str | None
    route: Route | None = None

    def key(self, name: str) -> str:
        """The dotted path of one of its keys within its file."""
        return f"{self.path}.{name}" if self.path else name


def read_route(
    file: str, name: str, path: str, data: dict[str, Any], problems: list[ConfigProblem]
) -> WrittenRoute:
    """Validate one route: a whole route file (``path`` empty) or a ``[routes.NAME]`` table.

    Returns:
        The route as written; its ``route`` is None if it has a problem
        (among ``problems``).
    """
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
    written = WrittenRoute(
        name=name, file=file, path=path, source=source or None, destination=destination or None
    )
    if len(problems) > before or pattern is None or source is None or destination is None:
        return written
    route = Route(
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
    return attrs.evolve(written, route=route)


def load_routes(directory: Path, problems: list[ConfigProblem]) -> tuple[WrittenRoute, ...]:
    """Read every ``*.toml`` route file of a directory, in name order.

    Returns:
        Each route file that holds a TOML table, valid or not (see `WrittenRoute`).
    """
    if not directory.is_dir():
        problems.append(ConfigProblem(str(directory), "-", "routes directory not found"))
        return ()
    routes: list[WrittenRoute] = []
    for path in sorted(directory.glob("*.toml")):
        named = NAME.match(path.stem) is not None
        if not named:
            problems.append(
                ConfigProblem(str(path), "-", "a route file name must be letters, digits, _.-")
            )
        data = read_toml(path, problems)
        if data is not None:
            # A file with a bad name is still read: its other problems are reported too.
            written = read_route(str(path), path.stem, "", data, problems)
            routes.append(written if named else attrs.evolve(written, route=None))
    return tuple(routes)
