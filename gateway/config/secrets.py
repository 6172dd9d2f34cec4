"""The secrets file, kept out of the main file, and the secrets the configuration needs.

Its tables keep apart what must not be confused: ``[logins]`` holds login
passwords and nothing else; DMP lease texts are in ``[leases]`` and the admin
API's token is ``admin_token``, so that neither logs anyone in. A file
written when both lived in ``[logins]`` is refused with what to move where.
``[fleet]`` holds what a fleet node logs in to RabbitMQ with (``[fleet] amqp``
of the main file): a user name and password of the broker, not of a peer;
and ``relay_secret``, what the nodes prove to each other when one relays to
another's stream listener (`gateway.protocols.stream.fleetlogin`); and
``lease_secret``, the key that signs the DMP leases nodes make at run time
(`gateway.fleet.leases`), which `check_lease_secret` asks for where a fleet
makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

from gateway.config.base import (
    ConfigProblem,
    Section,
    TableSchema,
    optional_string,
    read_toml,
    string_map,
    string_maps,
    table,
)
from gateway.config.listeners import ListenerConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.core.auth import Secrets

__all__ = ["FLEET_SECRETS", "SECRETS", "check_lease_secret", "check_secrets", "load_secrets"]

ADMIN_IDENTITY: Final = "admin"
"""The ``[logins]`` name whose secret was the admin token before ``admin_token``."""

ADMIN_TOKEN: Final = optional_string(
    "admin_token",
    doc="The admin API's bearer token (``/leases``, ``/tap``); written before the tables."
    " It is no login password.",
    shown="none: the gateway makes one in data_dir/admin-token (mode 0600)",
)
LOGINS: Final = string_map(
    "logins",
    doc="Identity = secret: SSMP ``secret`` logins, QMQP ``A`` blocks, stream PLAIN, MTL SASL,"
    ' DMP principals; ``"*"`` is a shared secret. Login passwords only.',
)
LEASES: Final = string_map(
    "leases",
    doc="DMP lease name (a DMP listener's ``leases``) = the lease text a client presents."
    " No lease text is a login password.",
)
UPSTREAMS: Final = string_map(
    "upstreams", doc="Upstream name = the secret the gateway logs in with (or its DMP lease)."
)
FRONTENDS: Final = string_maps(
    "frontends",
    doc="``[frontends.NAME]`` of an SSMP front-end: certificate name (or ``*``) = the secret"
    " presented to its backend.",
)

FLEET_USERNAME: Final = optional_string(
    "username",
    doc="The RabbitMQ user a fleet node logs in as (``[fleet] amqp`` of the main file).",
    shown="guest (RabbitMQ lets guest in from loopback only)",
)
FLEET_PASSWORD: Final = optional_string(
    "password", doc="That user's password.", shown="guest, with the user guest"
)
MIN_RELAY_SECRET_CHARS: Final = 16
"""A relay secret vouches for every identity on every node: not a short word."""
FLEET_RELAY_SECRET: Final = optional_string(
    "relay_secret",
    doc="What the nodes of a fleet prove (never send) to each other when one relays to"
    " another's stream listener: with it, relays carry their client's identity (PLAIN,"
    " EXTERNAL or ANONYMOUS), run over TLS on TLS listeners, and routes into a stream"
    f" listener append at the stream's owner. At least {MIN_RELAY_SECRET_CHARS} characters;"
    " the same on every node; no login password.",
    shown="none: relays log in as their clients did (PLAIN only, not on TLS listeners),"
    " and routes append to the routing node's own log",
)
MIN_LEASE_SECRET_CHARS: Final = 32
"""A lease secret signs every run-time DMP lease of the fleet: 32 random characters or more."""
FLEET_LEASE_SECRET: Final = optional_string(
    "lease_secret",
    doc="The key (HMAC-SHA256) that signs the DMP leases a fleet's nodes make at run time"
    " (the admin API, principal connections), so that every node accepts a lease any node"
    f" made. At least {MIN_LEASE_SECRET_CHARS} characters; the same on every node; no login"
    " password. Needed with [fleet] amqp, a DMP listener, and the admin endpoint or"
    " principals.",
    shown="none: a fleet makes no run-time DMP leases",
)
FLEET_SECRETS: Final = TableSchema(
    "Fleet credentials",
    "[fleet] (secrets file)",
    (FLEET_USERNAME, FLEET_PASSWORD, FLEET_RELAY_SECRET, FLEET_LEASE_SECRET),
    doc="What a fleet node logs in to RabbitMQ with, and what the nodes prove to each other;"
    " the same for every node. No login password of a peer.",
)
FLEET: Final = table(
    "fleet",
    FLEET_SECRETS,
    doc="RabbitMQ credentials of the fleet's nodes, and their relay secret (below).",
)

SECRETS: Final = TableSchema(
    "Secrets file",
    "secrets.toml",
    (ADMIN_TOKEN, LOGINS, LEASES, UPSTREAMS, FRONTENDS, FLEET),
    doc="The file that ``secrets`` in ``[gateway]`` names, kept out of the main file: tables of"
    " strings whose keys are names of your choosing. SIGHUP re-reads it; new logins are"
    " checked against the new secrets.",
)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8")


def load_secrets(path: Path, problems: list[ConfigProblem]) -> Secrets:
    """Read a secrets file (empty secrets, and the problems, when it cannot be used)."""
    data = read_toml(path, problems)
    if data is None:
        return Secrets()
    root = Section(str(path), "", data, problems, (SECRETS,))
    admin_token = root.read(ADMIN_TOKEN)
    logins = root.string_map(LOGINS, _utf8)
    leases = root.string_map(LEASES, _utf8)
    upstreams = root.string_map(UPSTREAMS, _utf8)
    frontends = root.string_maps(FRONTENDS, _utf8)
    fleet = root.section(FLEET)
    fleet_username = fleet.read(FLEET_USERNAME)
    fleet_password = fleet.read(FLEET_PASSWORD)
    if (fleet_username is None) != (fleet_password is None):
        fleet.problem(
            FLEET_PASSWORD if fleet_password is None else FLEET_USERNAME,
            "username and password go together: give both, or neither (guest)",
        )
        fleet_username = fleet_password = None
    relay_secret = fleet.read(FLEET_RELAY_SECRET)
    if relay_secret is not None and len(relay_secret) < MIN_RELAY_SECRET_CHARS:
        fleet.problem(
            FLEET_RELAY_SECRET,
            f"must be at least {MIN_RELAY_SECRET_CHARS} characters (it vouches for every"
            " identity on every node): give a long random one",
        )
        relay_secret = None
    lease_secret = fleet.read(FLEET_LEASE_SECRET)
    if lease_secret is not None and len(lease_secret) < MIN_LEASE_SECRET_CHARS:
        fleet.problem(
            FLEET_LEASE_SECRET,
            f"must be at least {MIN_LEASE_SECRET_CHARS} characters (it signs every run-time"
            " DMP lease of the fleet): give a long random one",
        )
        lease_secret = None
    fleet.done()
    if admin_token == "":
        root.problem(ADMIN_TOKEN, "an empty token would let any request in: give a long random one")
        admin_token = None
    if ADMIN_IDENTITY in logins and admin_token is None:
        root.problem(
            f"{LOGINS.name}.{ADMIN_IDENTITY}",
            "the admin token is no longer read from [logins] (there it was also the password"
            " of a login named 'admin' on every listener): move it to admin_token = ... at"
            " the top of this file; keep [logins] admin only for such a login, beside an"
            " admin_token of its own",
        )
    root.done()
    return Secrets(
        logins=logins,
        upstreams=upstreams,
        frontends=frontends,
        leases=leases,
        admin_token=_utf8(admin_token) if admin_token is not None else None,
        fleet_username=fleet_username,
        fleet_password=_utf8(fleet_password) if fleet_password is not None else None,
        fleet_relay_secret=_utf8(relay_secret) if relay_secret is not None else None,
        fleet_lease_secret=_utf8(lease_secret) if lease_secret is not None else None,
    )


def check_secrets(
    listeners: Sequence[ListenerConfig],
    upstreams: Sequence[UpstreamConfig],
    secrets: Secrets,
    secrets_path: Path | None,
    main_file: str,
    problems: list[ConfigProblem],
) -> None:
    """Report the secrets that listeners and upstreams need and the secrets file lacks.

    Args:
        listeners: The configuration's listeners.
        upstreams: Its upstreams.
        secrets: Its secrets file's contents (empty without one).
        secrets_path: The secrets file, where problems are reported; None
            without one, and then they are reported in ``main_file``.
        main_file: The main file.
        problems: Where problems go.
    """
    where = str(secrets_path) if secrets_path else main_file
    for listener in listeners:
        for lease, grant in getattr(listener.settings, "leases", {}).items():
            if grant.text is not None or lease in secrets.leases:
                continue
            if lease in secrets.logins:
                # Lease texts were read from [logins], where each was a login password too.
                problems.append(
                    ConfigProblem(
                        where,
                        f"{LOGINS.name}.{lease}",
                        f"lease {lease!r} of listener {listener.name!r}: lease texts are read"
                        f" from [leases] now, and one in [logins] would be a login password:"
                        f" move {lease} from [logins] to [leases]",
                    )
                )
            else:
                problems.append(
                    ConfigProblem(
                        where,
                        f"listeners.{listener.name}.leases.{lease}",
                        f"lease {lease!r} has no lease text: put it under [leases] {lease}",
                    )
                )
    for listener in listeners:
        if (
            listener.protocol == "frontend"
            and listener.settings.speaks == "ssmp"
            and not secrets.frontends.get(listener.name)
        ):
            problems.append(
                ConfigProblem(
                    where,
                    f"frontends.{listener.name}",
                    "an SSMP front-end logs in to its backend with a secret per certificate "
                    f"name: put them (or '*') under [frontends.{listener.name}]",
                )
            )
    for upstream in upstreams:
        how = _how_upstream_logs_in(upstream)
        if how is not None and secrets.credential_for(upstream.name) is None:
            problems.append(
                ConfigProblem(
                    where,
                    f"upstreams.{upstream.name}",
                    f"upstream {how} but no secret is configured for it"
                    + ("" if secrets_path else " (and gateway.secrets names no secrets file)"),
                )
            )


def check_lease_secret(
    in_fleet: bool,
    admin_on: bool,
    listeners: Sequence[ListenerConfig],
    secrets: Secrets,
    secrets_path: Path | None,
    main_file: str,
    problems: list[ConfigProblem],
) -> None:
    """Report a fleet that makes DMP leases at run time without ``[fleet] lease_secret``.

    In a fleet (``[fleet] amqp``) a lease made at run time is signed so that
    every node accepts it (`gateway.fleet.leases`); a DMP listener makes
    them through the admin endpoint's ``/leases`` and for its principals.

    Args:
        in_fleet: Whether ``[fleet] amqp`` is set.
        admin_on: Whether the admin endpoint is on.
        listeners: The configuration's listeners.
        secrets: Its secrets file's contents.
        secrets_path: The secrets file (None: there is none; reported in ``main_file``).
        main_file: The main file.
        problems: Where problems go.
    """
    if not in_fleet or secrets.fleet_lease_secret is not None:
        return
    makers = [
        listener.name
        for listener in listeners
        if listener.protocol == "dmp" and (admin_on or listener.settings.principals)
    ]
    if makers:
        problems.append(
            ConfigProblem(
                str(secrets_path) if secrets_path else main_file,
                f"{FLEET.name}.{FLEET_LEASE_SECRET.name}",
                f"DMP listener(s) {', '.join(map(repr, makers))} make leases at run time"
                " (the admin endpoint's /leases, principals), which every node of the fleet"
                " must accept: put a random lease_secret of at least"
                f" {MIN_LEASE_SECRET_CHARS} characters, the same on every node, in the"
                " secrets file's [fleet] table",
            )
        )


def _how_upstream_logs_in(upstream: UpstreamConfig) -> str | None:
    """How an upstream uses its secret, for the problem's reason; None: it needs none."""
    username = getattr(upstream.settings, "username", None)
    if getattr(upstream.settings, "scheme", None) == "secret":
        return "logs in with scheme 'secret'"
    if upstream.protocol == "dmp" and getattr(upstream.settings, "principal", None):
        return f"logs in as principal {upstream.settings.principal!r} (its secret)"
    if upstream.protocol == "dmp":
        return "presents a lease (its secret)"
    if username is not None and not (upstream.protocol == "stream" and username == "guest"):
        return f"authenticates as {username!r}"
    return None  # no secret needed (a stream upstream's guest defaults to "guest")
