"""The admin token a gateway makes for itself when its secrets file gives none.

The admin API's ``/tap`` and ``/leases`` need a bearer token. A secrets file
with ``admin_token`` gives it; without one, the gateway makes a random token
at its first start and keeps it in its data dir (`TOKEN_FILE`, mode 0600,
as Jupyter keeps its server token and RabbitMQ its Erlang cookie), so that
``msggateway tap`` works on a fresh install: run by a user who may read the
data dir, the command reads the token there (`read_admin_token`). The file
is used only while the secrets file has no ``admin_token``; the admin
endpoint itself stays where ``[admin]`` puts it, loopback by default.

Every process of a fleet on one host ([fleet] processes) reads the same file
in the main data dir: the first to start writes it, the others read it.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Final

from twisted.logger import Logger

from gateway.config.base import ConfigError, ConfigProblem
from gateway.config.loader import GatewayConfig
from gateway.files import write_once

__all__ = ["TOKEN_FILE", "provide_admin_token", "read_admin_token", "token_path"]

TOKEN_FILE: Final = "admin-token"
"""The token's file in the data dir."""
_TOKEN_BYTES: Final = 32
"""Random bytes in a new token (43 URL-safe characters)."""
_FILE_MODE: Final = 0o600

_log = Logger(namespace="gateway.config.admintoken")


def token_path(data_dir: Path) -> Path:
    """Where the gateway keeps the token it made."""
    return data_dir / TOKEN_FILE


def read_admin_token(data_dir: Path) -> str | None:
    """The token the gateway keeps in ``data_dir``; None when it has made none there.

    Raises:
        OSError: The file is there but cannot be read (another user's, mode 0600).
    """
    try:
        text = token_path(data_dir).read_text("ascii").strip()
    except FileNotFoundError:
        return None
    return text or None


def provide_admin_token(config: GatewayConfig) -> None:
    """Give the gateway its own admin token when the admin endpoint is on without one.

    With the admin endpoint on and no ``admin_token`` in the secrets file,
    the token kept in the data dir (made now if there is none) becomes
    ``config.secrets.generated_admin_token``, which the admin API accepts
    while the secrets file gives no token of its own (a reload may add one).

    Raises:
        ConfigError: The token file cannot be read or written; the problem names it.
    """
    if config.admin.endpoint is None or config.secrets.admin_token is not None:
        return
    path = token_path(config.data_dir)
    try:
        token = read_admin_token(config.data_dir)
        if token is None:
            _create(path, secrets.token_urlsafe(_TOKEN_BYTES))
            token = read_admin_token(config.data_dir)
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError([ConfigProblem(str(path), "-", f"admin token: {reason}")]) from None
    if token is None:
        raise ConfigError([ConfigProblem(str(path), "-", "admin token: written, then empty")])
    config.secrets.generated_admin_token = token.encode("ascii")
    _log.info(
        "admin API token: {path} (no secrets file gives admin_token; msggateway tap reads it"
        " there)",
        path=str(path),
    )


def _create(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` (mode 0600) unless a file is there (`write_once`)."""
    write_once(path, f"{token}\n", _FILE_MODE)
