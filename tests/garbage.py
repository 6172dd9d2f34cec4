"""A check that some work leaves no reference circles for the garbage collector.

Reference counting frees what no circle holds the moment it is dropped. What
a circle holds waits for the cyclic collector, whose collections pause the
reactor (about 2 ms for the youngest generation full of a paced route's
batches: `gateway.core.batch`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["no_circles_left"]


@contextmanager
def no_circles_left() -> Iterator[None]:
    """Fail if what the block made and dropped is only freed by the cyclic collector.

    The collector is off during the block; afterwards a collection must find
    nothing unreachable. Objects still referenced when the block ends are
    not garbage and are not counted.
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        found = gc.collect()
        if enabled:
            gc.enable()
    assert found == 0, f"{found} objects were left in reference circles"
