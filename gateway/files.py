"""Small files a gateway writes once and keeps: its node id, its admin token.

`write_once` writes a file whole or not at all, and never replaces one that
is there: when two processes start at once, the first to link its file wins
and both then read the same contents.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

__all__ = ["write_once"]


def write_once(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to ``path`` with ``mode`` unless a file is there; never a partial file.

    The text goes to a temporary file first (fsynced, its mode set whatever
    the umask), which is then linked as ``path``: a link never replaces an
    existing file, so the first writer wins. Where the file system has no
    links, it is renamed instead. The directory is fsynced so that the new
    name survives a crash.

    Raises:
        OSError: The directory or the file could not be made.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            os.fchmod(descriptor, mode)
            os.write(descriptor, text.encode("utf-8"))
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        _link_once(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    _fsync_directory(path.parent)


def _link_once(source: Path, target: Path) -> None:
    """Make ``target`` a link to ``source`` unless it exists; rename where links are missing."""
    try:
        os.link(source, target)
    except FileExistsError:
        pass  # another process wrote it first: that one stands
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        os.replace(source, target)


def _fsync_directory(directory: Path) -> None:
    """Make a new file's name durable, where the file system allows it."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
