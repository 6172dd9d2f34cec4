"""The secrets file, kept out of the main file, and the secrets the configuration needs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

from gateway.config.base import (
    ConfigProblem,
    Section,
    TableSchema,
    read_toml,
    string_map,
    string_maps,
)
from gateway.config.listeners import ListenerConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.core.auth import Secrets

__all__ = ["SECRETS", "check_secrets", "load_secrets"]

LOGINS: Final = string_map(
    "logins",
    doc="Identity = secret: SSMP ``secret`` logins, QMQP ``A`` blocks, stream PLAIN, MTL SASL,"
    ' DMP principals and lease texts; ``"*"`` is a shared secret; ``admin`` the admin token.',
)
UPSTREAMS: Final = string_map(
    "upstreams", doc="Upstream name = the secret the gateway logs in with (or its DMP lease)."
)
FRONTENDS: Final = string_maps(
    "frontends",
    doc="``[frontends.NAME]`` of an SSMP front-end: certificate name (or ``*``) = the secret"
    " presented to its backend.",
)

SECRETS: Final = TableSchema(
    "Secrets file",
    "secrets.toml",
    (LOGINS, UPSTREAMS, FRONTENDS),
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
    logins = root.string_map(LOGINS, _utf8)
    upstreams = root.string_map(UPSTREAMS, _utf8)
    frontends = root.string_maps(FRONTENDS, _utf8)
    root.done()
    return Secrets(logins=logins, upstreams=upstreams, frontends=frontends)


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
            if grant.text is None and lease not in secrets.logins:
                problems.append(
                    ConfigProblem(
                        where,
                        f"listeners.{listener.name}.leases.{lease}",
                        f"lease {lease!r} has no lease text: put it under [logins] {lease}",
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
