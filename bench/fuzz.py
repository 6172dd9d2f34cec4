"""Fuzz every codec, then a running gateway, and print what came out (issue 18).

Part one, in this process: for each of the ten codecs (``gateway/codecs``:
amqp, amqp091, dmp, fieldtable, framing, mtl, osiris, qmqp, ssmp, stream)
``--inputs`` generated inputs, shared among its decoding entry points
(`tests.fuzzing.targets.TARGETS`: both roles, each framing helper...). Each
input is, mostly, a valid encoding drawn from the hypothesis strategies
(``--pool`` of them per target, drawn once with a fixed seed) changed by
the seeded mutator of `tests.fuzzing.mutation` (truncations, bit flips,
inserted and deleted bytes, oversized binary and decimal lengths, splices,
MTL frames dropped or added); sometimes random bytes, a valid input as it
is, or a deep nesting (MTL JSON, field tables, AMQP 1.0 compound values;
`tests.fuzzing.nesting`). Each outcome is counted: decoded, the codec's
typed error, or anything else (unexpected: the first reproducers are
printed). A ``--split-fraction`` of the inputs of byte-stream codecs is
decoded again cut at random points and must give the same events and the
same error.

Part two: a gateway under twistd (`tests.fuzzing.connections.GATEWAY_CONFIG`,
every listener on loopback) takes ``--connections`` malformed connections
per protocol (SSMP, QMQP, stream, DMP over TCP; MTL over ZeroMQ with
malformed multipart messages, plus raw TCP garbage to its ports), then must
still run, still serve a valid exchange of every protocol, and have no
``Traceback`` or ``Unhandled`` in its log; its resident memory is printed
before and after each protocol's flood.

Bounded: ``--seconds`` caps the whole run (the codecs get four fifths of it
in equal shares, the protocols the rest); a part cut short by its share
prints the counts it reached. Exits non-zero on any unexpected exception,
split mismatch, traceback, exit or protocol no longer served.

Run from the repository root (``nice`` keeps a shared machine usable)::

    nice -n 10 .venv/bin/python -m bench.fuzz              # 1,000,000 inputs, 10,000 connections
    .venv/bin/python -m bench.fuzz --quick                 # a smoke run
    .venv/bin/python -m bench.fuzz --part codecs --only mtl --inputs 200000
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.codec_checks import split_at  # noqa: E402
from tests.fuzzing import connections  # noqa: E402
from tests.fuzzing.samples import Input  # noqa: E402
from tests.fuzzing.targets import (  # noqa: E402
    CODECS,
    TARGETS,
    FuzzTarget,
    decodes,
    draw_pool,
    fuzz_input,
    outcome,
    split_points,
)
from tests.integration.harness import GatewayProcess  # noqa: E402

REPRODUCERS_SHOWN = 3
"""Reproducers printed per target and kind of failure."""

REPR_BYTES = 600
"""Longest input printed in full; longer ones are cut (their seed and index reproduce them)."""

CHECK_EVERY = 512
"""Inputs between two looks at the clock."""


@dataclasses.dataclass(slots=True)
class CodecRun:
    """The counts of one target's run."""

    name: str
    inputs: int = 0
    ok: int = 0
    typed: int = 0
    unexpected: int = 0
    split_checked: int = 0
    split_mismatch: int = 0
    seconds: float = 0.0
    capped: bool = False
    reproducers: list[str] = dataclasses.field(default_factory=list)


def _show(parts: Input) -> str:
    shown = [part if len(part) <= REPR_BYTES else part[:REPR_BYTES] for part in parts]
    sizes = ", ".join(str(len(part)) for part in parts)
    return f"{tuple(shown)!r} (part sizes {sizes})"


def _reproducer(run: CodecRun, what: str, parts: Input, index: int, seed: int, detail: str) -> None:
    if len(run.reproducers) < REPRODUCERS_SHOWN:
        run.reproducers.append(
            f"{run.name} {what} (seed {seed}, input {index}): {detail}\n    input: {_show(parts)}"
        )


def fuzz_target(
    target: FuzzTarget,
    count: int,
    *,
    seed: int,
    pool_size: int,
    split_fraction: float,
    until: float,
) -> CodecRun:
    """Run ``count`` fuzz inputs through one target (until the clock passes ``until``)."""
    run = CodecRun(target.name)
    pool = draw_pool(target, pool_size, seed)
    rng = random.Random(f"{seed}-{target.name}")
    started = time.perf_counter()
    for index in range(count):
        if index % CHECK_EVERY == 0 and time.monotonic() > until:
            run.capped = True
            break
        parts = fuzz_input(target, rng, pool)
        run.inputs += 1
        try:
            if decodes(target, parts):
                run.ok += 1
            else:
                run.typed += 1
        except Exception as exc:  # anything but a typed error: counted and shown, the point here
            run.unexpected += 1
            detail = "".join(traceback.format_exception(exc)[-3:]).strip()
            _reproducer(run, "UNEXPECTED", parts, index, seed, detail)
            continue
        if target.split and rng.random() < split_fraction:
            run.split_checked += 1
            stream = parts[0]
            points = split_points(rng, len(stream))
            try:
                same = outcome(target, split_at(stream, points)) == outcome(target, parts)
            except Exception as exc:  # as above
                run.unexpected += 1
                _reproducer(run, f"UNEXPECTED cut at {points}", parts, index, seed, repr(exc))
                continue
            if not same:
                run.split_mismatch += 1
                _reproducer(run, f"SPLIT MISMATCH cut at {points}", parts, index, seed, "")
    run.seconds = time.perf_counter() - started
    return run


def fuzz_codecs(args: argparse.Namespace, until: float) -> list[CodecRun]:
    """Every selected codec's targets, ``args.inputs`` inputs per codec."""
    runs: list[CodecRun] = []
    codecs = [codec for codec in CODECS if not args.only or codec in args.only]
    start = time.monotonic()
    for position, codec in enumerate(codecs):
        targets = [target for target in TARGETS if target.codec == codec]
        share = start + (until - start) * (position + 1) / len(codecs)
        for index, target in enumerate(targets):
            each = -(-args.inputs // len(targets))
            deadline = time.monotonic() + (share - time.monotonic()) / (len(targets) - index)
            run = fuzz_target(
                target,
                each,
                seed=args.seed,
                pool_size=args.pool,
                split_fraction=args.split_fraction,
                until=deadline,
            )
            runs.append(run)
            print(f"  {run.name}: {run.inputs:,} inputs in {run.seconds:.1f} s", flush=True)
    return runs


@dataclasses.dataclass(slots=True)
class ProtocolRun:
    """One protocol's flood and the checks after it."""

    protocol: str
    result: connections.FloodResult
    alive: bool
    serving: dict[str, bool]
    tracebacks: int
    rss_before_kib: int
    rss_after_kib: int
    seconds: float


def _tracebacks(log: str) -> int:
    return sum(log.count(marker) for marker in connections.TRACEBACK_MARKERS)


def flood_gateway(args: argparse.Namespace, until: float) -> tuple[list[ProtocolRun], str]:
    """Start a gateway, flood each protocol, check it after each; the runs and its log."""
    runs: list[ProtocolRun] = []
    protocols = [name for name in connections.PROTOCOLS if not args.only or name in args.only]
    pools = connections.payload_pools(args.pool, args.seed)
    with tempfile.TemporaryDirectory(prefix="fuzz-") as directory:
        gateway = GatewayProcess(Path(directory), connections.GATEWAY_CONFIG).start()
        try:
            start = time.monotonic()
            for position, protocol in enumerate(protocols):
                deadline = start + (until - start) * (position + 1) / len(protocols)
                rng = random.Random(f"{args.seed}-{protocol}")
                address = gateway.address(protocol)
                before = connections.rss_kib(gateway.pid)
                started = time.perf_counter()
                if protocol == "mtl":
                    result = connections.mtl_flood(
                        address,
                        args.connections,
                        rng=rng,
                        concurrency=args.concurrency,
                        deadline=deadline,
                    )
                else:
                    result = connections.flood(
                        address,
                        connections.payloads(protocol, rng, pools[protocol], args.connections),
                        answered_when=connections.HANDSHAKE_ANSWERED[protocol],
                        concurrency=args.concurrency,
                        seed_value=rng.randrange(2**32),
                        deadline=deadline,
                    )
                seconds = time.perf_counter() - started
                alive = connections.alive(gateway.pid)
                serving = {
                    name: alive and connections.serves(name, gateway.address(name))
                    for name in connections.PROTOCOLS
                }
                runs.append(
                    ProtocolRun(
                        protocol,
                        result,
                        alive,
                        serving,
                        _tracebacks(gateway.output()),
                        before,
                        connections.rss_kib(gateway.pid) if alive else 0,
                        seconds,
                    )
                )
                print(f"  {protocol}: {result.connections:,} connections in {seconds:.1f} s")
                if not alive:
                    break
        finally:
            gateway.stop()
        return runs, gateway.output()


def print_codec_table(runs: list[CodecRun]) -> bool:
    """The codec table; whether every run was clean."""
    header = (
        f"{'codec target':<24} {'inputs':>10} {'ok':>10} {'typed errors':>12} "
        f"{'unexpected':>10} {'split checks':>12} {'mismatch':>8} {'inputs/s':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    per_codec: dict[str, int] = {}
    for run in runs:
        rate = run.inputs / run.seconds if run.seconds else 0.0
        mark = " (capped)" if run.capped else ""
        print(
            f"{run.name:<24} {run.inputs:>10,} {run.ok:>10,} {run.typed:>12,} "
            f"{run.unexpected:>10,} {run.split_checked:>12,} {run.split_mismatch:>8,} "
            f"{rate:>9,.0f}{mark}"
        )
        codec = run.name.partition("/")[0]
        per_codec[codec] = per_codec.get(codec, 0) + run.inputs
    print("-" * len(header))
    print("inputs per codec: " + ", ".join(f"{c} {n:,}" for c, n in per_codec.items()))
    clean = True
    for run in runs:
        for line in run.reproducers:
            print(line)
        clean = clean and not run.unexpected and not run.split_mismatch
    return clean


def print_protocol_table(runs: list[ProtocolRun], log: str) -> bool:
    """The protocol table; whether the gateway came through every flood."""
    header = (
        f"{'protocol':<8} {'connections':>11} {'reset':>6} {'unclosed':>8} {'answered':>8} "
        f"{'alive':>5} {'serving':>7} {'tracebacks':>10} {'RSS before -> after (MB)':>24} "
        f"{'conn/s':>7}"
    )
    print()
    print(header)
    print("-" * len(header))
    clean = True
    for run in runs:
        result = run.result
        serving = all(run.serving.values())
        rss = f"{run.rss_before_kib / 1024:.1f} -> {run.rss_after_kib / 1024:.1f}"
        rate = result.connections / run.seconds if run.seconds else 0.0
        print(
            f"{run.protocol:<8} {result.connections:>11,} {result.reset:>6,} "
            f"{result.unclosed:>8,} {result.answered:>8,} {'yes' if run.alive else 'NO':>5} "
            f"{'yes' if serving else 'NO':>7} {run.tracebacks:>10} {rss:>24} {rate:>7,.0f}"
        )
        if not serving:
            print(f"  not served after the {run.protocol} flood: {run.serving}")
        clean = clean and run.alive and serving and not run.tracebacks
    print("-" * len(header))
    print(
        "reset: refused, reset or closed before the whole payload was sent; unclosed: half-closed"
        " and not closed by the gateway within 10 s (MTL: a ZeroMQ peer whose last request went"
        " unanswered); answered: the gateway sent something back"
    )
    if runs and runs[0].rss_before_kib:
        print(
            f"gateway RSS: {runs[0].rss_before_kib / 1024:.1f} MB before the floods,"
            f" {runs[-1].rss_after_kib / 1024:.1f} MB after"
        )
    if _tracebacks(log):
        where = min(log.find(marker) for marker in connections.TRACEBACK_MARKERS if marker in log)
        print("first traceback in the gateway's log:\n" + log[max(0, where - 500) : where + 3000])
    return clean


def main() -> None:
    """Parse the options, run both parts, print the tables, exit 1 on any failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="fuzz inputs per codec")
    parser.add_argument(
        "--connections", type=int, default=10_000, help="malformed connections per protocol"
    )
    parser.add_argument("--seconds", type=float, default=1140.0, help="cap on the whole run")
    parser.add_argument("--quick", action="store_true", help="20,000 inputs, 500 connections")
    parser.add_argument("--seed", type=int, default=18, help="seeds every draw")
    parser.add_argument("--pool", type=int, default=300, help="valid inputs drawn per target")
    parser.add_argument(
        "--split-fraction", type=float, default=0.25, help="inputs also decoded cut up"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="connections open at once")
    parser.add_argument("--part", choices=("codecs", "connections", "both"), default="both")
    parser.add_argument(
        "--only", action="append", help="a codec or protocol (repeatable); all when absent"
    )
    args = parser.parse_args()
    if args.quick:
        args.inputs, args.connections, args.pool = 20_000, 500, 100
    started = time.monotonic()
    end = started + args.seconds
    codec_share = 0.8 if args.part == "both" else 1.0
    clean = True
    if args.part in ("codecs", "both"):
        print(f"fuzzing the codecs: {args.inputs:,} inputs per codec, seed {args.seed}", flush=True)
        runs = fuzz_codecs(args, started + args.seconds * codec_share)
        clean = print_codec_table(runs) and clean
    if args.part in ("connections", "both"):
        print(
            f"\nflooding a gateway: {args.connections:,} malformed connections per protocol",
            flush=True,
        )
        protocol_runs, log = flood_gateway(args, end)
        clean = print_protocol_table(protocol_runs, log) and clean
    print(f"\n{'clean' if clean else 'FAILED'} in {time.monotonic() - started:.0f} s")
    sys.exit(0 if clean else 1)


if __name__ == "__main__":
    main()
