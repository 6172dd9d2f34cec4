"""Sampling profiles of a gateway under a benchmark, with py-spy.

`Recording` attaches ``py-spy record`` to a running gateway and stops it
(SIGINT, on which py-spy writes what it sampled) when the block ends; the
file is py-spy's *raw* format, one collapsed stack per line with its count
of samples. Only the thread holding the GIL is sampled (``--gil``): where
the gateway's Python time goes, not threads waiting (the log's writer
thread in its queue or in fsync). `top` reads such files and gives the functions the samples
were in, by *self* time (the innermost frame): where the time goes, not who
called it.

py-spy is not one of the project's dependencies (``pip install py-spy``);
a profiled run samples the gateway 100 times a second, which costs it a few
per cent, so its rates are not the ones to compare.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Final

__all__ = ["SAMPLES_PER_SECOND", "Recording", "top"]

SAMPLES_PER_SECOND: Final = 100
_FRAME: Final = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
"""A py-spy frame: ``function (path/to/file.py:line)``."""
_STOP_SECONDS: Final = 15.0


class Recording:
    """``py-spy record`` on process ``pid`` into ``output`` while the block runs.

    Raises:
        RuntimeError: py-spy is not installed.
    """

    def __init__(self, pid: int, output: Path) -> None:
        beside = Path(sys.executable).parent / "py-spy"  # a virtualenv's, not on PATH
        binary = str(beside) if beside.is_file() else shutil.which("py-spy")
        if binary is None:
            raise RuntimeError("profiling needs py-spy: pip install py-spy")
        self.output = output
        self._process = subprocess.Popen(
            [binary, "record", "--pid", str(pid), "--rate", str(SAMPLES_PER_SECOND),
             "--format", "raw", "--gil", "--nonblocking", "--output", str(output)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def __enter__(self) -> Recording:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sampling; py-spy writes its file (the target may be gone already)."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _leaf(stack: str) -> str:
    """The innermost frame of a collapsed stack, as ``function (file)``."""
    frame = stack.rsplit(";", 1)[-1]
    found = _FRAME.match(frame)
    if found is None:
        return frame
    path = found["file"]
    for marker in ("site-packages/", "/gateway/", "/lib/python"):
        if marker in path:
            path = path[path.index(marker) + 1 :]
            break
    return f"{found['function']} ({path})"


def top(files: Iterable[Path], count: int = 5) -> tuple[int, list[tuple[str, float]]]:
    """The samples in ``files`` and the ``count`` functions with the most self time.

    Returns:
        The number of samples, and each function with its share of them.
    """
    selves: Counter[str] = Counter()
    total = 0
    for path in files:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, number = line.rpartition(" ")
            if not stack or not number.isdigit():
                continue
            samples = int(number)
            total += samples
            selves[_leaf(stack)] += samples
    if not total:
        return 0, []
    return total, [(name, samples / total) for name, samples in selves.most_common(count)]
