"""CURVE key files for MTL: what ``msggateway mtl keygen`` writes.

A key file holds one Z85 secret key (40 characters and a newline), the
format ``curve_secret_key_file`` reads (`gateway.protocols.mtl.settings`).
The public key, which clients need, is derived from it and printed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_key_pair"]


def write_key_pair(path: Path) -> bytes:
    """Make a CURVE key pair; write its secret key to a new file; return the public key.

    The file is created readable by its owner only, and never overwritten.

    Raises:
        OSError: The file exists or cannot be written.
    """
    import zmq

    public_key, secret_key = zmq.curve_keypair()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(secret_key + b"\n")
    return public_key
