"""Tests for `gateway.fleet.node` and ``[fleet] node``: one id per process, kept.

The id is configured, or generated the first time and kept in
``<data_dir>/node-id``; either way it is checked, and a kept file that holds
no id stops the start with the file named, rather than being replaced.
"""

from __future__ import annotations

import errno
import os
import stat
import textwrap
from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactorClock

from gateway.config import ConfigError, load_config
from gateway.config.fleet import FleetConfig, node_id
from gateway.fleet.node import (
    MAX_NODE_ID_CHARS,
    NODE_ID_FILE,
    NodeIdError,
    generate_node_id,
    load_node_id,
    node_id_problem,
    node_reference,
)


def test_a_new_data_dir_gets_an_id_once_and_keeps_it(tmp_path: Path) -> None:
    """The first load writes ``gw-`` and 8 base32 characters; later loads read the same."""
    data_dir = tmp_path / "missing" / "data"
    first = load_node_id(data_dir)
    assert first.startswith("gw-") and len(first) == len("gw-") + 8
    assert node_id_problem(first) is None
    path = data_dir / NODE_ID_FILE
    assert path.read_text() == f"{first}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert load_node_id(data_dir) == first
    assert sorted(p.name for p in data_dir.iterdir()) == [NODE_ID_FILE]  # no temporary left


def test_the_file_is_written_whatever_the_umask(tmp_path: Path) -> None:
    """A umask of 077 still gives a file others may read (0644): it holds no secret."""
    old = os.umask(0o077)
    try:
        load_node_id(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / NODE_ID_FILE).stat().st_mode) == 0o644


def test_two_data_dirs_get_two_ids(tmp_path: Path) -> None:
    """Each data dir, so each process, has its own generated id."""
    assert load_node_id(tmp_path / "a") != load_node_id(tmp_path / "b")
    assert len({generate_node_id() for _ in range(1000)}) == 1000


def test_a_kept_id_is_read_with_or_without_its_newline(tmp_path: Path) -> None:
    """An id an operator wrote by hand (``echo -n``, or with spaces around) is read."""
    (tmp_path / NODE_ID_FILE).write_text("  edge-1.eu_west \n")
    assert load_node_id(tmp_path) == "edge-1.eu_west"


def test_a_configured_id_wins_and_leaves_the_file_alone(tmp_path: Path) -> None:
    """``[fleet] node`` is the id; no file is read or written for it."""
    assert load_node_id(tmp_path, "edge-1") == "edge-1"
    assert not (tmp_path / NODE_ID_FILE).exists()
    (tmp_path / NODE_ID_FILE).write_text("not an id!\n")
    assert load_node_id(tmp_path, "edge-1") == "edge-1"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "must not be empty"),
        (b"\n", "must not be empty"),
        (b"two words\n", "must be ASCII letters"),
        (b"-leading-dash\n", "must be ASCII letters"),
        (b"caf\xc3\xa9\n", "must be ASCII text"),
        (b"x" * (MAX_NODE_ID_CHARS + 1), f"at most {MAX_NODE_ID_CHARS} characters"),
    ],
    ids=["empty", "newline", "space", "dash", "utf-8", "long"],
)
def test_a_bad_file_is_an_error_naming_it_and_is_kept(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    """A file that holds no id stops the start, says why, and is not replaced.

    Replacing it would give the process new publisher references silently.
    """
    path = tmp_path / NODE_ID_FILE
    path.write_bytes(content)
    with pytest.raises(NodeIdError) as raised:
        load_node_id(tmp_path)
    assert raised.value.file == path
    assert reason in raised.value.reason
    assert "[fleet] node" in raised.value.reason
    assert path.read_bytes() == content


def test_an_unreadable_file_is_an_error_naming_it(tmp_path: Path) -> None:
    """A node-id that is a directory (or unreadable) is reported with the system's reason."""
    (tmp_path / NODE_ID_FILE).mkdir()
    with pytest.raises(NodeIdError) as raised:
        load_node_id(tmp_path)
    assert raised.value.file == tmp_path / NODE_ID_FILE
    assert raised.value.reason.startswith("cannot read: ")


def test_a_data_dir_below_a_file_is_an_error(tmp_path: Path) -> None:
    """A data dir that cannot be one: the error names the file it wanted."""
    (tmp_path / "file").write_text("")
    data_dir = tmp_path / "file" / "data"
    with pytest.raises(NodeIdError) as raised:
        load_node_id(data_dir)
    assert raised.value.file == data_dir / NODE_ID_FILE
    assert raised.value.reason == "cannot read: Not a directory"


def test_a_failed_write_is_an_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while writing a new id: an error, no id file, no temporary file."""

    def full(descriptor: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(NodeIdError) as raised:
        load_node_id(tmp_path)
    assert raised.value.reason == "cannot write a new node id: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_an_id_written_meanwhile_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When another start writes an id between our read and our write, both use that one."""
    real_link = os.link

    def link_after_another(source: str, target: str) -> None:
        Path(target).write_text("gw-first00\n")
        real_link(source, target)

    monkeypatch.setattr(os, "link", link_after_another)
    assert load_node_id(tmp_path) == "gw-first00"
    assert sorted(p.name for p in tmp_path.iterdir()) == [NODE_ID_FILE]


def test_the_assembly_sees_a_bad_file_as_a_config_problem(tmp_path: Path) -> None:
    """`node_id` turns the file's problem into a ConfigError: file, ``-``, reason."""
    (tmp_path / NODE_ID_FILE).write_text("no good\n")
    with pytest.raises(ConfigError) as raised:
        node_id(FleetConfig(), tmp_path)
    [problem] = raised.value.problems
    assert (problem.file, problem.key) == (str(tmp_path / NODE_ID_FILE), "-")
    assert "not a node id" in problem.reason
    assert node_id(FleetConfig(node="edge-1"), tmp_path) == "edge-1"


@pytest.mark.parametrize(
    "node",
    ["gw-abcdefgh", "edge-1", "EU_west.3", "7", "a" * MAX_NODE_ID_CHARS],
)
def test_valid_ids(node: str) -> None:
    """Letters, digits, ``-``, ``_`` and ``.``, starting with a letter or digit, up to 64."""
    assert node_id_problem(node) is None


@pytest.mark.parametrize(
    "node",
    ["", ".hidden", "_x", "a b", "a/b", "a:b", "é", "a" * (MAX_NODE_ID_CHARS + 1)],
)
def test_invalid_ids(node: str) -> None:
    """Anything else has a reason."""
    assert node_id_problem(node)


def test_a_node_reference_appends_the_id() -> None:
    """``<reference>.<node>``, within 255 bytes for any reference the configuration takes."""
    assert node_reference("msggateway.rabbit", "gw-abcdefgh") == "msggateway.rabbit.gw-abcdefgh"
    longest = node_reference("r" * 190, "n" * MAX_NODE_ID_CHARS)
    assert len(longest.encode()) == 255


# --- [fleet] in the main file ---------------------------------------------------------


def _main(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_without_fleet_the_node_is_left_to_the_data_dir(tmp_path: Path) -> None:
    """No ``[fleet]`` table: no configured node."""
    assert load_config(_main(tmp_path, "")).fleet == FleetConfig(node=None)


def test_a_configured_node_is_read(tmp_path: Path) -> None:
    """``[fleet] node`` is the id."""
    config = load_config(_main(tmp_path, '[fleet]\nnode = "edge-1"\n'))
    assert config.fleet == FleetConfig(node="edge-1")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('node = "a b"', "must be ASCII letters"),
        ('node = ""', "must not be empty"),
        (f'node = "{"n" * 65}"', "at most 64 characters, not 65"),
        ("node = 7", "must be a string"),
        ('nodes = "x"', "unknown key; did you mean 'node'?"),
    ],
)
def test_a_bad_fleet_table_names_file_key_and_reason(
    tmp_path: Path, text: str, reason: str
) -> None:
    """Each problem names the main file and the key under ``fleet``."""
    main = _main(tmp_path, f"[fleet]\n{text}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(main)
    [problem] = raised.value.problems
    assert problem.file == str(main)
    assert problem.key == "fleet." + text.split(" ")[0]
    assert reason in problem.reason


def test_a_configured_reference_leaves_room_for_the_node_id(tmp_path: Path) -> None:
    """A stream upstream's ``publisher_reference`` is at most 190 bytes: 255 with the id."""
    upstream = """
        [upstreams.rabbit]
        protocol = "stream"
        endpoint = "tcp:host=127.0.0.1:port=5552"
        publisher_reference = "{reference}"
        """
    fits = load_config(_main(tmp_path, upstream.format(reference="r" * 190)))
    assert fits.upstreams[0].settings.publisher_reference == "r" * 190
    with pytest.raises(ConfigError) as raised:
        load_config(_main(tmp_path, upstream.format(reference="r" * 191)))
    [problem] = raised.value.problems
    assert problem.key == "upstreams.rabbit.publisher_reference"
    assert "at most 190 UTF-8 bytes" in problem.reason


# --- the assembly ----------------------------------------------------------------------


UPSTREAM_CONFIG = """
    [gateway]
    data_dir = "data"

    [admin]
    enabled = false

    [upstreams.rabbit]
    protocol = "stream"
    endpoint = "tcp:host=127.0.0.1:port=5552"
    """


def test_the_assembly_gives_the_node_id_to_upstreams_and_metrics(tmp_path: Path) -> None:
    """`build_gateway` keeps a new id in data_dir, and the upstream and /metrics carry it."""
    from gateway.protocols.stream.client import StreamUpstream
    from gateway.service import build_gateway

    config = load_config(_main(tmp_path, UPSTREAM_CONFIG))
    gateway = build_gateway(config, MemoryReactorClock())
    node = (tmp_path / "data" / NODE_ID_FILE).read_text().strip()
    assert gateway.node == node
    upstream = gateway.endpoints["rabbit"].destination
    assert isinstance(upstream, StreamUpstream)
    assert upstream.reference == f"msggateway.rabbit.{node}"
    assert upstream.consumer_name == "msggateway.rabbit"
    sample = gateway.metrics.registry.get_sample_value("msggateway_node_info", {"node": node})
    assert sample == 1
    again = build_gateway(config, MemoryReactorClock())
    assert again.node == node


def test_the_assembly_takes_a_configured_or_given_node(tmp_path: Path) -> None:
    """``[fleet] node`` is used as it is; a node handed to `build_gateway` wins (twistd's)."""
    from gateway.service import build_gateway

    config = load_config(_main(tmp_path, UPSTREAM_CONFIG + '\n[fleet]\nnode = "edge-1"\n'))
    assert build_gateway(config, MemoryReactorClock()).node == "edge-1"
    assert not (tmp_path / "data" / NODE_ID_FILE).exists()
    assert build_gateway(config, MemoryReactorClock(), "edge-2").node == "edge-2"
