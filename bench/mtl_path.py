"""The MTL listener's own Python work per message, without ZeroMQ: routed path and test profile.

bench/bridges.py's ``mtl-routed`` row times the gateway whole, ZeroMQ and
its I/O threads included, on two cores shared with the client: a change of
a tenth of a microsecond drowns there. This bench drives the listeners'
handlers directly, as tests/protocols/test_mtl_server.py does (sockets
replaced by counters that take everything), in read bursts of ``--burst``
messages, and times them on one thread:

* routed: two listeners on one router (the bridges row's route, ``in`` on
  ``mtl`` to ``out`` on ``mtl2``); a burst of a confirm=full writer's
  Contents, then a burst of the confirm=full reader's Confirms, one per
  Content, each Content's outcome back to the writer as one Confirm with
  ``multiple``: µs per routed message;
* test profile: a burst of a writer's Contents fanned out to one reader:
  µs per Content.

Each path runs ``--repeats`` times; the table gives the fastest (the least
disturbed) and the median, and the routed path's against the test
profile's in the same run. ``--tree DIR`` times another checkout's code
(``git worktree add DIR REV``) in the same way, for a before figure.

Run: ``python bench/mtl_path.py [--burst 83] [--bursts 2000] [--tree DIR]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Taken:
    """A data socket that takes everything it is given and counts it."""

    connection = None

    def __init__(self) -> None:
        self.count = 0

    def send_routed(self, messages: list[list[bytes]]) -> tuple[list[int], list[int]]:
        """Take them all."""
        self.count += len(messages)
        return [], []

    def send_many(self, messages: list[list[bytes]]) -> list[int]:
        """Take them all."""
        self.count += len(messages)
        return []

    def send_in_order(self, messages: Iterable[list[bytes]]) -> tuple[int, bool]:
        """Take them all."""
        taken = sum(1 for _ in messages)
        self.count += taken
        return taken, False


def routed_path(bursts: int, size: int) -> Callable[[], int]:
    """The routed path, ready to run: returns how many messages it routes."""
    from gateway.codecs import mtl
    from tests.protocols.test_mtl_server import bridge

    world = bridge()
    writers, readers = world.writers, world.readers
    writers._data, readers._data = Taken(), Taken()
    total = bursts * size
    # The writer's Lease was 1; its Contents follow. The reader's Contents are numbered from 1.
    contents = [
        [b"w", *mtl.encode_data(mtl.Content(n, "in", {}, b"x" * 100))] for n in range(2, total + 2)
    ]
    confirms = [[b"r", *mtl.encode_data(mtl.Confirm(n, False))] for n in range(1, total + 1)]
    turn = world.clock.advance

    def run() -> int:
        for start in range(0, total, size):
            for frames in contents[start : start + size]:
                writers._on_data(frames)
            writers._drained()
            turn(0)
            for frames in confirms[start : start + size]:
                readers._on_data(frames)
            readers._drained()
            turn(0)
        if writers._in_flight or readers._data.count != total:
            raise SystemExit("routed path: not every Content was delivered and confirmed")
        return total

    return run


def test_path(bursts: int, size: int) -> Callable[[], int]:
    """The test profile's fan-out, ready to run: returns how many Contents it fans out."""
    from gateway.codecs import mtl
    from tests.protocols.test_mtl_server import data, lease, server

    listener, clock, control, _sent = server()
    data(
        listener,
        b"r",
        mtl.Lease(1, lease(listener, control, "Reader", "none", ["resource"], "test")),
    )
    data(listener, b"r", mtl.Summon(2, "resource"))
    data(
        listener,
        b"w",
        mtl.Lease(1, lease(listener, control, "Writer", "none", ["resource"], "test")),
    )
    listener._data = taken = Taken()
    total = bursts * size
    contents = [
        [b"w", *mtl.encode_data(mtl.Content(n, "resource", {}, b"x" * 100))]
        for n in range(2, total + 2)
    ]

    def run() -> int:
        for start in range(0, total, size):
            for frames in contents[start : start + size]:
                listener._on_data(frames)
            listener._drained()
            clock.advance(0)
        if taken.count != total:
            raise SystemExit("test profile: not every Content went to the reader")
        return total

    return run


def measure(bursts: int, size: int, repeats: int) -> dict[str, list[float]]:
    """Each path's µs per message, ``repeats`` times (this process's code)."""
    times: dict[str, list[float]] = {"routed": [], "test": []}
    for _ in range(repeats):
        for name, make in (("routed", routed_path), ("test", test_path)):
            run = make(bursts, size)
            started = time.perf_counter()
            count = run()
            times[name].append((time.perf_counter() - started) / count * 1e6)
    return times


def in_tree(tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """`measure` on another checkout's code, in a child process."""
    code = (
        "import json, runpy, sys; sys.path.insert(0, sys.argv[1]);"
        " measure = runpy.run_path(sys.argv[2])['measure'];"
        " print(json.dumps(measure(*map(int, sys.argv[3:]))))"
    )
    command = [sys.executable, "-c", code, str(tree), __file__]
    command += [str(args.bursts), str(args.burst), str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    figures: dict[str, list[float]] = json.loads(done.stdout)
    return figures


def main() -> None:
    """Time both paths (and another tree's, if given) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--burst", type=int, default=83, help="messages per read burst")
    parser.add_argument("--bursts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="another checkout, timed the same way")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    rows: list[tuple[str, dict[str, list[float]]]] = []
    for _ in range(2 if args.tree else 1):  # in turns, twice, when comparing
        rows.append(("this tree", measure(args.bursts, args.burst, args.repeats)))
        if args.tree:
            rows.append((str(args.tree), in_tree(args.tree, args)))
    merged: dict[str, dict[str, list[float]]] = {}
    for name, figures in rows:
        for path, values in figures.items():
            merged.setdefault(name, {}).setdefault(path, []).extend(values)
    print(f"{'code':24} {'routed us/msg':>14} {'(median)':>9} {'test us/msg':>12} {'(median)':>9}"
          f" {'routed/test':>12}")  # fmt: skip
    for name, figures in merged.items():
        routed, test = min(figures["routed"]), min(figures["test"])
        print(
            f"{name:24} {routed:>14.3f} {statistics.median(figures['routed']):>9.3f}"
            f" {test:>12.3f} {statistics.median(figures['test']):>9.3f} {routed / test:>11.2f}x"
        )
    print(
        f"fastest of {len(next(iter(merged.values()))['routed'])} runs of {args.bursts} bursts of"
        f" {args.burst}; routed: µs per routed message (Content, Confirm and the writer's share"
        " of its Confirm); test: µs per Content fanned out; no ZeroMQ"
    )


if __name__ == "__main__":
    main()
