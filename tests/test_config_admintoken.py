"""The admin token the gateway makes for itself (`gateway.config.admintoken`)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.config.admintoken import TOKEN_FILE, provide_admin_token, read_admin_token
from gateway.core.auth import Secrets


def _main(directory: Path, *, secrets: str | None = None, admin: bool = True) -> Path:
    text = '[gateway]\ndata_dir = "data"\n'
    if secrets is not None:
        (directory / "secrets.toml").write_text(secrets)
        text += 'secrets = "secrets.toml"\n'
    text += '[admin]\nendpoint = "tcp:0:interface=127.0.0.1"\n' if admin else ""
    if not admin:
        text += "[admin]\nenabled = false\n"
    path = directory / "gateway.toml"
    path.write_text(text)
    return path


def test_without_an_admin_token_the_gateway_makes_one_readable_by_its_user_only(
    tmp_path: Path,
) -> None:
    """A long random token in data_dir/admin-token, mode 0600, which the admin API accepts."""
    config = load_config(_main(tmp_path))
    provide_admin_token(config)
    path = tmp_path / "data" / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = read_admin_token(tmp_path / "data")
    assert token is not None and len(token) >= 40
    assert config.secrets.is_admin_token(token.encode())
    assert not config.secrets.is_admin_token(b"something else")
    again = load_config(_main(tmp_path))
    provide_admin_token(again)  # the next start reads the same one
    assert again.secrets.generated_admin_token == token.encode()
    assert [p.name for p in (tmp_path / "data").iterdir()] == [TOKEN_FILE]


def test_the_secrets_files_token_comes_first(tmp_path: Path) -> None:
    """With admin_token in the secrets file nothing is made, and only that token is accepted."""
    config = load_config(_main(tmp_path, secrets='admin_token = "from-the-file"\n'))
    provide_admin_token(config)
    assert not (tmp_path / "data" / TOKEN_FILE).exists()
    assert config.secrets.generated_admin_token is None
    assert config.secrets.is_admin_token(b"from-the-file")


def test_no_admin_endpoint_no_token(tmp_path: Path) -> None:
    """An admin endpoint that is off needs no token: none is made."""
    config = load_config(_main(tmp_path, admin=False))
    provide_admin_token(config)
    assert not (tmp_path / "data").exists()


def test_a_reload_keeps_the_made_token_until_the_file_gives_one(tmp_path: Path) -> None:
    """A secrets file re-read without a token keeps the made one; one with a token replaces it."""
    config = load_config(_main(tmp_path, secrets="[logins]\nalice = 'a'\n"))
    provide_admin_token(config)
    made = config.secrets.generated_admin_token
    assert made is not None
    config.secrets.update(Secrets(logins={"bob": b"b"}))
    assert config.secrets.is_admin_token(made)
    config.secrets.update(Secrets(admin_token=b"now-in-the-file"))
    assert config.secrets.is_admin_token(b"now-in-the-file")
    assert not config.secrets.is_admin_token(made)


def test_a_data_dir_that_cannot_be_written_is_a_problem_naming_the_file(tmp_path: Path) -> None:
    """The token file cannot be made: a ConfigError naming it, as for any problem before start."""
    (tmp_path / "data").write_text("a file where the data dir should be")
    config = load_config(_main(tmp_path))
    with pytest.raises(ConfigError) as raised:
        provide_admin_token(config)
    [problem] = raised.value.problems
    assert problem.file == str(tmp_path / "data" / TOKEN_FILE)
    assert problem.reason.startswith("admin token: ")
