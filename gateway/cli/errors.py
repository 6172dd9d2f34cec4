"""How a ``msggateway`` command fails, and the exit status each failure gives.

Exit status, everywhere: 0 when everything was accepted (or received), 1
when something was refused, failed or timed out (`CommandError`, or a
refusal in the output), 2 for usage errors (`UsageError`).
"""

from __future__ import annotations

__all__ = [
    "CommandError",
    "UsageError",
]


class UsageError(Exception):
    """The command line asks for something impossible (exit status 2)."""


class CommandError(Exception):
    """The command could not do its work: refused, closed, timed out (exit status 1)."""
