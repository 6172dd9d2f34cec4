"""Benchmark the SSMP hub with ssmpload against a baseline in the same run.

Starts the gateway (``twistd msggateway``, open login on a loopback port) and
the naive Twisted hub of ``bench/naive_hub.py``, drives each with the
independent Go load generator ``../shared/tools/ssmpload`` in the same
scenarios, and prints each figure with its ratio to the baseline:

* MCAST 1 publisher to 1 subscriber, as fast as possible (deliveries/s);
* MCAST 4 publishers to 4 subscribers (deliveries/s);
* UCAST 1 to 1 (deliveries/s);
* latency at 10,000 MCAST/s, 1 to 1 (p50 and p99, microseconds).

Every run is bounded by ssmpload's ``-max`` message count and ``-duration``.
Run it with ``./dev bench`` (which installs Go and builds ssmpload), or
``python bench/ssmp_hub.py --ssmpload PATH``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import GatewayProcess  # noqa: E402

SCENARIOS: list[tuple[str, list[str], list[str]]] = [
    ("mcast 1->1", ["-mode", "mcast", "-pubs", "1", "-subs", "1"], ["deliv_rate", "p99_us"]),
    ("mcast 4->4", ["-mode", "mcast", "-pubs", "4", "-subs", "4"], ["deliv_rate"]),
    ("ucast 1->1", ["-mode", "ucast", "-pubs", "1", "-subs", "1"], ["deliv_rate"]),
    (
        "mcast 10k/s",
        ["-mode", "mcast", "-pubs", "1", "-subs", "1", "-rate", "10000", "-max", "100000"],
        ["p50_us", "p99_us", "srv_cpu_pct"],
    ),
]
HIGHER_IS_BETTER = {"deliv_rate"}

GATEWAY_CONFIG = """
[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
# The floods measure throughput against a naive hub that buffers without
# bound; with the default 4 MiB a subscriber that falls behind in the 4->4
# flood is cut off as a slow consumer (as it should be in production).
max_backlog_bytes = 1073741824
"""


def build_ssmpload(target: Path | None = None) -> Path:
    """Build ssmpload from ../shared/tools (Go standard library only).

    Args:
        target: Where the binary goes (default: ``ssmpload`` in the temporary directory).
    """
    source = ROOT.parent / "shared" / "tools" / "ssmpload"
    target = target or Path(tempfile.gettempdir()) / "ssmpload"
    subprocess.run(
        ["go", "build", "-o", str(target), "."],
        cwd=source,
        check=True,
        env=dict(os.environ, GO111MODULE="off"),
    )
    return target


def run_load(ssmpload: Path, port: int, pid: int, args: list[str]) -> dict[str, float]:
    """Run one ssmpload scenario; return its RESULT figures (exit on loss or disorder)."""
    figures, problem = load_figures(ssmpload, port, pid, args)
    if problem:
        raise SystemExit(problem)
    return figures


def load_figures(
    ssmpload: Path, port: int, pid: int, args: list[str], timeout: float = 120
) -> tuple[dict[str, float], str | None]:
    """Run one ssmpload scenario; return its RESULT figures and what went wrong, if anything.

    The second item names loss, reordering or duplicates (with the RESULT
    line), or is None. Later ``args`` override the defaults given here
    (``-size 100 -duration 10s``); the run is killed after ``timeout`` seconds.
    """
    command = [
        str(ssmpload), "-addr", f"127.0.0.1:{port}", "-size", "100",
        "-duration", "10s", "-pid", str(pid), *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    figures = dict(item.split("=", 1) for item in result.split()[1:])
    problem = None
    if int(figures["ooo"]) or int(figures["dups"]) or figures["delivered"] != figures["expected"]:
        problem = f"ssmpload saw loss, reordering or duplicates: {result}"
    return {key: float(value) for key, value in figures.items() if _is_number(value)}, problem


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@contextmanager
def gateway_server() -> Iterator[tuple[int, int]]:
    """The gateway under twistd; yields (port, pid)."""
    with tempfile.TemporaryDirectory() as directory:
        process = GatewayProcess(Path(directory), GATEWAY_CONFIG).start()
        try:
            yield process.address("hub")[1], process.pid
        finally:
            process.stop()


@contextmanager
def naive_server() -> Iterator[tuple[int, int]]:
    """The naive baseline hub; yields (port, pid)."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "naive_hub.py")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline().split()[1])
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(10)


def main() -> None:
    """Measure both servers and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ssmpload", type=Path, help="ssmpload binary (default: build it)")
    args = parser.parse_args()
    ssmpload = args.ssmpload or build_ssmpload()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for server_name, server in (("gateway", gateway_server), ("naive", naive_server)):
        for scenario, load_args, _keys in SCENARIOS:
            with server() as (port, pid):  # a fresh server per scenario
                figures = run_load(ssmpload, port, pid, load_args)
            results.setdefault(scenario, {})[server_name] = figures
            print(f"{server_name:8} {scenario:12} done", file=sys.stderr)
    print(f"{'scenario':12} {'figure':12} {'gateway':>12} {'naive':>12} {'ratio':>8}")
    for scenario, _load_args, keys in SCENARIOS:
        for key in keys:
            ours = results[scenario]["gateway"][key]
            base = results[scenario]["naive"][key]
            ratio = (
                (ours / base if key in HIGHER_IS_BETTER else base / ours) if ours and base else 0
            )
            print(f"{scenario:12} {key:12} {ours:12.0f} {base:12.0f} {ratio:7.2f}x")
    print("ratio > 1: the gateway is better (higher rate, lower latency or CPU)")


if __name__ == "__main__":
    main()
