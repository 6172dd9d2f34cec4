"""A check that some work leaves no reference circles for the garbage collector.

Reference counting frees what no circle holds the moment it is dropped. What
a circle holds waits for the cyclic collector, whose collections pause the
reactor (about 2 ms for the youngest generation full of a paced route's
batches: `gateway.core.batch`).
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["no_circles_left"]

_OURS = ("gateway.", "tests.", "twisted.")
"""Modules whose objects a circle of the gateway's own holds (a Deferred is Twisted's)."""


def _ours(thing: object) -> str | None:
    module = getattr(thing, "__module__", None) or type(thing).__module__
    if isinstance(module, str) and module.startswith(_OURS):
        return getattr(thing, "__qualname__", None) or type(thing).__qualname__
    return None


@contextmanager
def no_circles_left() -> Iterator[None]:
    """Fail if what the block made and dropped is only freed by the cyclic collector.

    The collector is off during the block; afterwards a collection must find
    nothing unreachable of the gateway's, the tests' or Twisted's (objects,
    functions, methods), so that another thread's garbage cannot fail it.
    Objects still referenced when the block ends are not garbage.
    """
    gc.collect()
    enabled = gc.isenabled()
    flags = gc.get_debug()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(flags | gc.DEBUG_SAVEALL)  # keep what it finds, to name it
        try:
            gc.collect()
            found = Counter(name for name in map(_ours, gc.garbage) if name is not None)
            gc.garbage.clear()
        finally:
            gc.set_debug(flags)
            if enabled:
                gc.enable()
    assert not found, f"left in reference circles: {dict(found)}"
