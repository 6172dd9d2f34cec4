"""MTL listener configuration: the SASL ``mechanisms`` key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.protocols.mtl.settings import MTLListenerSettings

LISTENER = """
[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
"""


def test_mechanisms_default_to_plain(tmp_path: Path) -> None:
    """Without the key, an MTL listener offers PLAIN only."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER)
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.mechanisms == ("PLAIN",)


def test_mechanisms_are_case_insensitive_and_ordered(tmp_path: Path) -> None:
    """``mechanisms`` keeps the order given (the 401 reply's), in capitals."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + 'mechanisms = ["scram-sha-256", "PLAIN"]\n')
    (listener,) = load_config(main).listeners
    assert isinstance(listener.settings, MTLListenerSettings)
    assert listener.settings.mechanisms == ("SCRAM-SHA-256", "PLAIN")


@pytest.mark.parametrize("value", ['["CRAM-MD5"]', "[]", '["PLAIN", "GSSAPI"]'])
def test_unknown_or_no_mechanisms_name_the_key(tmp_path: Path, value: str) -> None:
    """An unknown mechanism, or none, is a config error naming file, key and the choices."""
    main = tmp_path / "gateway.toml"
    main.write_text(LISTENER + f"mechanisms = {value}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(main)
    (problem,) = caught.value.problems
    assert (problem.file, problem.key) == (str(main), "listeners.mtl.mechanisms")
    assert "PLAIN, SCRAM-SHA-256" in problem.reason
