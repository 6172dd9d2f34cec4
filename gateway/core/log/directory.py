"""Stream directories: safe names for any stream name, and the ``meta.json`` they hold.

A stream lives in ``<store>/<directory name>/``. The directory name keeps
ASCII letters, digits, ``_`` and ``-`` and writes every other UTF-8 byte as
``%XX``, so it can never be ``.``, ``..``, hold a ``/`` or collide with
another stream; names that would escape past `MAX_PLAIN_NAME_CHARS` are cut
and suffixed with ``~`` and a SHA-256 prefix. Since escaped names never hold
a ``.``, suffixes after a dot (`DELETING_SUFFIX`, `ORPHAN_SUFFIX`) mark the
store's own work directories. The real name lives in ``meta.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import string
from pathlib import Path
from typing import Final

from gateway.core.log.values import Retention

__all__ = [
    "DELETING_SUFFIX",
    "MAX_PLAIN_NAME_CHARS",
    "META_FILE",
    "ORPHAN_SUFFIX",
    "decode_meta",
    "directory_name",
    "encode_meta",
    "fsync_directory",
    "write_meta",
]

META_FILE: Final = "meta.json"
"""The stream's own settings, and its real name."""
DELETING_SUFFIX: Final = ".deleting"
"""A stream directory renamed on its way to deletion; removed at open."""
ORPHAN_SUFFIX: Final = ".orphan"
"""A directory without a readable ``meta.json``, set aside (never deleted) at open."""
MAX_PLAIN_NAME_CHARS: Final = 160
"""Escaped names longer than this are hashed, well within the 255-byte file name limit."""
_SAFE: Final = frozenset((string.ascii_letters + string.digits + "_-").encode())
_META_VERSION: Final = 1


def directory_name(stream: str) -> str:
    """The directory name for a stream name (any non-empty UTF-8 text)."""
    escaped = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in stream.encode("utf-8"))
    if len(escaped) <= MAX_PLAIN_NAME_CHARS:
        return escaped
    digest = hashlib.sha256(stream.encode("utf-8")).hexdigest()[:32]
    return f"{escaped[:120]}~{digest}"


def encode_meta(name: str, retention: Retention) -> bytes:
    """The ``meta.json`` contents for a stream."""
    document = {
        "version": _META_VERSION,
        "name": name,
        "retention": {
            "max_bytes": retention.max_bytes,
            "max_age_seconds": retention.max_age_seconds,
            "max_segment_bytes": retention.max_segment_bytes,
        },
    }
    return json.dumps(document, indent=2, sort_keys=True).encode("utf-8") + b"\n"


def decode_meta(data: bytes) -> tuple[str, Retention]:
    """Read a stream's name and retention from ``meta.json`` contents.

    Raises:
        ValueError: Not JSON, not version 1, or a field missing or invalid.
    """
    document = json.loads(data.decode("utf-8"))
    if not isinstance(document, dict) or document.get("version") != _META_VERSION:
        raise ValueError("not a version 1 stream meta file")
    name = document.get("name")
    settings = document.get("retention")
    if not isinstance(name, str) or not name or not isinstance(settings, dict):
        raise ValueError("stream meta file lacks a name or retention")
    try:
        retention = Retention(
            max_bytes=settings.get("max_bytes"),
            max_age_seconds=settings.get("max_age_seconds"),
            max_segment_bytes=settings["max_segment_bytes"],
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad retention in stream meta file: {exc}") from None
    return name, retention


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(directory: Path, name: str, retention: Retention, *, sync: bool) -> None:
    """Write ``meta.json`` atomically: a temporary file, fsynced, renamed into place.

    Blocking: call it from the writer thread or at start-up.
    """
    target = directory / META_FILE
    temporary = directory / (META_FILE + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, encode_meta(name, retention))
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(temporary, target)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if sync:
        fsync_directory(directory)
