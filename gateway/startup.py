"""How a gateway that cannot start ends: one critical line, no traceback repeating it."""

from __future__ import annotations

__all__ = ["StartFailed"]


class StartFailed(SystemExit):
    """The gateway cannot start, and a critical line has said why.

    A `SystemExit` with status 1: twistd lets it through, so the process
    ends without a traceback repeating that line.
    """

    def __init__(self) -> None:
        super().__init__(1)
