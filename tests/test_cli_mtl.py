"""``msggateway mtl keygen``: a CURVE key file an MTL listener loads, and its public key."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import zmq

from gateway.cli import main
from gateway.config import load_config
from gateway.protocols.mtl.settings import MTLListenerSettings


def test_keygen_writes_a_key_the_listener_loads(tmp_path: Path) -> None:
    """The file is private, loads as curve_secret_key_file, and matches the printed key."""
    out, err = io.StringIO(), io.StringIO()
    assert main(["mtl", "keygen", str(tmp_path / "mtl.key")], out=out, err=err) == 0
    assert stat.S_IMODE((tmp_path / "mtl.key").stat().st_mode) == 0o600
    main_file = tmp_path / "gateway.toml"
    main_file.write_text(
        '[listeners.mtl]\nprotocol = "mtl"\nendpoint = "tcp:0"\ncurve_secret_key_file = "mtl.key"\n'
    )
    (listener,) = load_config(main_file).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    secret_key = listener.settings.curve_secret_key
    assert secret_key is not None
    assert out.getvalue() == zmq.curve_public(secret_key).decode() + "\n"
    assert err.getvalue() == ""


def test_keygen_never_overwrites(tmp_path: Path) -> None:
    """An existing file is left alone and the command fails, saying why."""
    (tmp_path / "mtl.key").write_text("keep me")
    out, err = io.StringIO(), io.StringIO()
    assert main(["mtl", "keygen", str(tmp_path / "mtl.key")], out=out, err=err) == 1
    assert (tmp_path / "mtl.key").read_text() == "keep me"
    assert "File exists" in err.getvalue() and out.getvalue() == ""
